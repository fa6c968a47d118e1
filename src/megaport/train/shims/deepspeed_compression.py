"""``deepspeed-compression``: DeepSpeed's removed compression module, served with functions that raise.

Megatron-DeepSpeed (2022-08 on) imports ``deepspeed.compression.compress`` unconditionally in
``megatron/training.py``, for ``--compression-training`` only; DeepSpeed 0.18 removed the library.
The module is served with both functions raising; the run does not use them.
"""

from __future__ import annotations

import sys

from megaport.train.shims._pattern import Match
from megaport.train.shims._serve import ServedModules

NAME = "deepspeed-compression"
DESCRIPTION = ("DeepSpeed's removed compression module (Megatron-DeepSpeed imports it for --compression-training) "
               "served with functions that raise")
ERAS = "Megatron-DeepSpeed 2022-08 on, with DeepSpeed >= 0.18"
REPRODUCES = "deepspeed < 0.18, which still had deepspeed.compression.compress"
MODULE = "deepspeed.compression.compress"
PATTERN = (Match(("ModuleNotFoundError",), module=r"deepspeed\.compression\.compress"),)


def _removed(*args, **kwargs):
    raise RuntimeError("deepspeed.compression.compress was removed in DeepSpeed 0.18 (megaport baseline shim)")


def _fill(module) -> None:
    module.init_compression = module.redundancy_clean = _removed


def install() -> None:
    # Last on sys.meta_path: asked only where DeepSpeed itself has no such module.
    sys.meta_path.append(ServedModules({MODULE: _fill}))
