"""For trees without ``pretrain_gpt.py``: a few training steps through upstream's megatron.core builders.

A tree made from PyPI's ``megatron-core`` (what CI can download) has no ``pretrain_gpt.py`` and,
before 0.17, no ``megatron/training``. Every tree that has the script trains through it
(:mod:`megaport.train.pretrain`); the harness serves the others, for the training smoke test, the
loss-parity test and ``megaport bench --train``, in two modules:

- :mod:`~megaport.train.harness.launcher`: starts a fresh interpreter for one run and reads the
  JSON document it prints (:func:`~megaport.train.harness.launcher.run_in_subprocess`), and runs
  the unported upstream commit the same way
  (:func:`~megaport.train.harness.launcher.upstream_baseline`);
- :mod:`~megaport.train.harness.worker`: that interpreter (``python -m megaport.train.harness``):
  builds GPT from the tree's megatron.core, trains it and prints the document.
"""
