"""The smoke suite ``megaport verify`` runs against a ported tree, under pytest.

It ships inside the package so that a ROCm machine needs nothing but megaport, pytest and its own
torch. ``megaport verify`` starts ``python -m pytest`` on this folder in a fresh process with the
tree first on ``PYTHONPATH`` and these options (see conftest.py):

``--megaport-tree DIR``          the ported tree whose own code is tested
``--megaport-device cpu|cuda|hip``
``--megaport-masked-rows zero|uniform``  the era's kernel semantics, from the series' catalogue entry
``--megaport-results FILE``      where to write the JSON results (device report, tests, summary)

Every test imports Megatron from the tree, never megaport's copy of the replacements; megaport's
own modules here are the harness only (references, guard, reporting). Files:

- ``test_imports.py``: every module the series touched imports, and apex, amp_C and the fused
  ``*_cuda`` extensions stay out even where they are installed.
- ``test_kernels.py``: the tree's softmax functions and FusedScaleMaskSoftmax against fp64
  references with the era's semantics, forward and backward, gradcheck.
- ``test_apex_substitutes.py``: optimizer, layer norm, grad-norm/scale helpers and
  weight-gradient accumulation against plain PyTorch.
- ``test_distributed.py``: two ranks through torch's elastic launcher, the tree's backend
  resolution, exact collectives, tensor-parallel layers at TP=2 against the unsharded layer.
- ``test_training.py``: the tree's own ``pretrain_gpt.py`` under torchrun with the era's example
  flags, shrunk (on the CPU with the substitutions of megaport.cpu_substitutions); the loss upstream logs
  must fall and match the unported upstream commit with its fusions off. Trees without the
  script (PyPI's megatron-core) train through upstream's builders in-process instead.

The suite's own helpers, one concern each: ``_session.py`` (the run's settings, kept on pytest's
config), ``_guard.py`` (the import guard and its raising stand-ins), ``_locate.py`` (the tree's own
modules, and where in the tree an error was raised), ``_era.py`` (what the era has: the unported
upstream commit decides), ``_verdicts.py`` (skip or fail when tree code cannot import or run here),
``_backend.py`` (the tree's ``--distributed-backend`` default), ``_launch.py`` and
``_dist_worker.py`` (the 2-rank run), ``_fork.py`` (Megatron-DeepSpeed trees).
"""

from pathlib import Path

SMOKE_DIR = Path(__file__).resolve().parent
