"""The baseline's shims: the least that lets unported upstream start on today's stack, one module each.

The yardstick for loss parity is the unported upstream commit run as a ROCm user without megaport
runs it (:mod:`megaport.train.baseline`). Some eras cannot even start without apex or
TransformerEngine, or on today's torch and NumPy; there, and only after a run died of exactly
that (:func:`~megaport.train.shims.registry.pick`, by the exception and the frame that raised it), the baseline gets the shim
that answers it, and the report lists it. Each shim is its own module here, listed in
:data:`~megaport.train.shims.registry.REGISTRY`:

- ``NAME``, ``DESCRIPTION`` (what the report says), ``ERAS``, ``REPRODUCES`` (the upstream fix or
  library whose behaviour it gives);
- ``PATTERN``: the failures it answers (:class:`~megaport.train.shims._pattern.Match`);
- ``install()``: run in the baseline's processes at start-up, before upstream's first import;
- optionally ``applies(tree)``: whether it has anything to do in that unported tree (a model
  family's up-front shims are installed, and listed, only where it does); ``PATTERN`` may then be
  empty, for a shim no failure asks for (``kernel-masked-rows``: a semantic the fused kernel has).

No shim reads, imports or copies the port (``megaport.replacements``): a fault in the port's
code must show as a parity failure, never sit on both sides of it. Every baseline process proves
it at exit (:mod:`megaport.train.shims.audit`).
"""
