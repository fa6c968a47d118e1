"""``stack``: names today's torch and NumPy removed that 2020-2023 upstream uses, as they were.

``torch._six`` (gone in torch 2.0; upstream's clip_grads imports ``inf`` from it), NumPy's aliases
of builtins (gone in NumPy 1.24/2.0; the indexed dataset's dtype table uses ``np.float``) and
``torch.distributed._backend`` (2021's DDP reads it), and ``TypedStorage._untyped()`` (renamed in
torch 2.0; the distributed optimizer of main 2022-09-30 … 2023-12-01 views its grad buffers through it).
Nothing computational.
"""

from __future__ import annotations

import collections.abc
import math
import sys
import types

from megaport.train.shims._pattern import Match

NAME = "stack"
DESCRIPTION = ("torch._six, NumPy's removed aliases, torch.distributed._backend and TypedStorage._untyped restored "
               "(nothing computational)")
ERAS = "E1-E3 and the fork (2020-2023 code)"
REPRODUCES = "torch < 2.0 and NumPy < 1.24, which those trees were written for"
PATTERN = (Match(("ModuleNotFoundError",), module=r"torch\._six"),
           Match(("AttributeError",), message=r"^module 'numpy' has no attribute"),
           Match(("AttributeError",), message=r"^module 'torch\.distributed' has no attribute '(_backend|dist_backend)'"),
           Match(("AttributeError",), message=r"'torch\.storage\.TypedStorage' object has no attribute '_untyped'"))

# NumPy < 1.24's aliases of builtins, and its old spellings of names it still has.
NUMPY_BUILTIN_ALIASES = {"float": float, "int": int, "bool": bool, "object": object, "str": str, "long": int,
                         "unicode": str, "complex": complex}
NUMPY_OLD_SPELLINGS = {"float_": "float64", "complex_": "complex128", "string_": "bytes_", "unicode_": "str_",
                       "product": "prod", "cumproduct": "cumprod", "alltrue": "all", "sometrue": "any",
                       "NaN": "nan", "NAN": "nan", "Inf": "inf", "Infinity": "inf", "infty": "inf", "PINF": "inf"}


def _six() -> types.ModuleType:
    six = types.ModuleType("torch._six")
    six.inf, six.nan, six.PY3, six.PY37 = math.inf, math.nan, True, True
    six.string_classes, six.int_classes, six.container_abcs = (str, bytes), int, collections.abc
    return six


def install() -> None:
    import numpy
    import torch

    if not hasattr(torch, "_six"):
        sys.modules["torch._six"] = torch._six = _six()
    for alias, value in NUMPY_BUILTIN_ALIASES.items():
        numpy.__dict__.setdefault(alias, value)
    for alias, name in NUMPY_OLD_SPELLINGS.items():
        numpy.__dict__.setdefault(alias, getattr(numpy, name))
    dist = torch.distributed
    if dist.is_available() and "_backend" not in dist.__dict__:
        dist.dist_backend = getattr(dist, "dist_backend", dist.Backend)
        dist._backend = "undefined"  # torch 1.x's value before init_process_group, which sets it

        def init_process_group(*args, _init=dist.init_process_group, **kwargs):
            _init(*args, **kwargs)
            dist._backend = dist.get_backend()

        dist.init_process_group = init_process_group
    typed = getattr(torch.storage, "TypedStorage", None)
    if typed is not None and not hasattr(typed, "_untyped"):
        typed._untyped = lambda self: self._untyped_storage  # torch 1.x's name for it
