"""The yardstick: the unported upstream commit a ported tree came from, as a user without megaport
runs it (its fusions off, no megaport code anywhere).

It is exported from the tree's own git objects into a temporary folder, so the tree is never
touched. Upstream of 2023-07 to 2024-06 cannot even import without TransformerEngine (its
megatron/core imports TE layers unguarded); there, and only after a run failed for exactly that
reason, the baseline gets an import stub of ``transformer_engine`` that provides nothing: any use
of it raises. That stub is the one baseline shim, and the report lists it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from megaport.git import export_commit

TE_MISSING = "No module named 'transformer_engine'"
TE_STUB = "transformer_engine import stub (provides nothing; any use raises)"

_TE_STUB_SOURCE = '''"""Import stub of TransformerEngine for megaport's baseline run: it provides nothing.

Upstream of 2023-07 to 2024-06 imports TE layers at module level, unguarded, even when the run
uses --transformer-impl local. Every name here is a placeholder class: subclassing it at import
works, and any use (calling, instantiating, reading an attribute) raises.
"""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise ImportError("transformer_engine is a megaport baseline stub: TransformerEngine is not installed")

    def __init_subclass__(cls, **kwargs):
        pass


class _Namespace:
    def __init__(self, name):
        self.__name__ = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (_Unavailable,), {"__module__": self.__name__})
        return _Namespace(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise ImportError("transformer_engine is a megaport baseline stub: TransformerEngine is not installed")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_Namespace("transformer_engine"), name)
'''


@contextlib.contextmanager
def unported_upstream(tree, sha: str):
    """The commit ``sha`` of ``tree``'s history exported to a temporary folder, and an environment
    without the tree's PYTHONPATH: ``(folder, env)``."""
    with tempfile.TemporaryDirectory(prefix="megaport-upstream-") as folder:
        export_commit(tree, sha, folder)
        yield folder, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def with_te_stub(env: dict, stub_dir: str) -> dict:
    """``env`` with a TransformerEngine import stub written into ``stub_dir`` first on PYTHONPATH."""
    package = os.path.join(stub_dir, "transformer_engine")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w", encoding="utf-8") as f:
        f.write(_TE_STUB_SOURCE)
    paths = [stub_dir] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}
