"""Finding things in a ported tree of any era: its own modules, and where in it an error was raised.

It locates the tree's own modules (megatron.core.fusions.fused_softmax, or
megatron/model/fused_softmax.py in old eras; the package megatron/core/rocm_port or megatron/rocm_port)
and never supplies an implementation of its own.
"""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path

FUSED_SOFTMAX_MODULES = (
    "megatron.core.fusions.fused_softmax",   # core_v0.4 and later
    "megatron.legacy.model.fused_softmax",   # core_v0.6 to 0.16, legacy models
    "megatron.model.fused_softmax",          # before megatron/core/fusions
)
ROCM_PORT_MODULES = ("megatron.core.rocm_port", "megatron.rocm_port")
MASK_FUNC_MODULES = ("megatron.core.transformer.utils", "megatron.legacy.model.utils", "megatron.model.utils")
# The tensor-parallel layers (megatron.core's from 2022-11, megatron.mpu's before), in the order
# the suite imports them.
TP_LAYERS = ("megatron/core/tensor_parallel/layers.py", "megatron/mpu/layers.py")


def module_path(name: str) -> tuple[str, str]:
    """'megatron.core.optimizer' → ('megatron/core/optimizer.py', 'megatron/core/optimizer/__init__.py')."""
    base = name.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


def module_name(path: str) -> str | None:
    """'megatron/core/fusions/fused_softmax.py' → 'megatron.core.fusions.fused_softmax'."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def import_first(names):
    """The first of ``names`` that the tree has; (None, reasons) when none imports."""
    reasons = []
    for name in names:
        try:
            return importlib.import_module(name), None
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                reasons.append(f"{name}: not in this tree")
                continue
            raise
    return None, "; ".join(reasons)


def home_of(value):
    """The module that defines ``value`` (a function or class the port's package re-exports): where
    its globals live, so a test that changes one for the duration changes what the code reads."""
    import sys

    return sys.modules[value.__module__]


def in_port(rel: Path) -> bool:
    """Whether a path inside the tree is one of the port package's files."""
    return "rocm_port" in rel.parts[:-1]


def is_under(module, tree: Path) -> bool:
    location = getattr(module, "__file__", None)
    return location is not None and is_under_path(Path(location), tree)


def is_under_path(path: Path, tree: Path) -> bool:
    try:
        path.resolve().relative_to(tree.resolve())
        return True
    except ValueError:
        return False


def tree_frame(exc: BaseException, tree: Path) -> str:
    """'megatron/core/x.py:12: import apex' for the innermost frame of the tree in a traceback."""
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            rel = Path(frame.filename).resolve().relative_to(tree.resolve())
        except (ValueError, OSError):
            continue
        if in_port(rel) and frame.name == "find_spec":
            continue  # the blocker refusing: the importing line is the frame before it
        found = f"{rel}:{frame.lineno}: {(frame.line or '').strip()}"
    return found


def env_with_paths(*paths: str | Path) -> dict:
    """os.environ with ``paths`` first on PYTHONPATH (for the subprocesses the suite starts)."""
    from megaport.envpaths import with_paths_first

    return with_paths_first(None, *paths)
