"""``transformer-engine``: an import stub of TransformerEngine that provides nothing.

Upstream of 2023-07 to 2024-06 imports TE layers at module level, unguarded, even when the run
uses ``--transformer-impl local``, and asks importlib.metadata for TE's version. The stub answers
both: every name is a placeholder class that can be subclassed at import and raises
:class:`TransformerEngineStubUsed` on any use; but ``transformer_engine.pytorch.LayerNorm`` and
``RMSNorm``, with which core 0.4-0.7 build the final norm whatever the layer spec, are torch's.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

from megaport.train.shims._pattern import Match
from megaport.train.shims._serve import serve

NAME = "transformer-engine"
DESCRIPTION = ("transformer_engine import stub (provides nothing but its LayerNorm/RMSNorm in PyTorch, which core "
               "0.4-0.7 build the final norm with whatever the layer spec; any other use raises)")
ERAS = "E4-E6 (main 2023-07 … 2024-06)"
REPRODUCES = "a machine without TransformerEngine, where upstream's unguarded imports still succeed"
PATTERN = (Match(("ModuleNotFoundError",), module=r"transformer_engine(\..*)?"),
           Match(("PackageNotFoundError",), message=r"transformer.engine"))
VERSION = "0.0.0+megaport.stub"


class TransformerEngineStubUsed(ImportError):
    """A TE name was used, not just imported: the baseline cannot build that with the stub."""


def _unavailable(*args, **kwargs):
    raise TransformerEngineStubUsed("transformer_engine is a megaport baseline stub: TransformerEngine is not installed")


class _Placeholder:
    def __init__(self, *args, **kwargs):
        _unavailable()

    def __init_subclass__(cls, **kwargs):
        pass


class _Namespace:
    """``te.a.b.C``: namespaces all the way down; capitalised names are placeholder classes."""

    def __init__(self, name):
        self.__name__ = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (_Placeholder,), {"__module__": self.__name__})
        return _Namespace(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        _unavailable()


def _torch_norm(kind: str):
    """TE's norm signature over torch's norm (what core 0.4-0.7's final TENorm builds)."""
    import torch

    class Norm(getattr(torch.nn, kind)):
        def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, zero_centered_gamma=False,
                     params_dtype=None, device=None, **kwargs):
            if zero_centered_gamma:
                _unavailable()
            super().__init__(hidden_size, eps=eps, dtype=params_dtype, device=device)

    Norm.__name__ = Norm.__qualname__ = kind
    return Norm


class _PyTorchNamespace(_Namespace):
    def __getattr__(self, name):
        if name in ("LayerNorm", "RMSNorm"):
            return _torch_norm(name)
        return super().__getattr__(name)


def _module_getattr(name: str):
    """``transformer_engine.<name>`` for any name the module does not define."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_Namespace("transformer_engine"), name)


def _fill(module) -> None:
    module.__version__ = VERSION
    module.pytorch = _PyTorchNamespace("transformer_engine.pytorch")
    module.__getattr__ = _module_getattr


class _StubDistribution(importlib.metadata.Distribution):
    def read_text(self, filename):
        return f"Metadata-Version: 2.1\nName: transformer-engine\nVersion: {VERSION}\n" \
            if filename == "METADATA" else None

    def locate_file(self, path):
        return None


def _find_distributions(context=importlib.metadata.DistributionFinder.Context()):
    name = context.name
    if name is None or re.sub(r"[-_.]+", "_", name).lower() == "transformer_engine":
        yield _StubDistribution()


def install() -> None:
    finder = serve({"transformer_engine": _fill}, packages={"transformer_engine"})
    finder.find_distributions = _find_distributions
    sys.modules.pop("transformer_engine", None)
