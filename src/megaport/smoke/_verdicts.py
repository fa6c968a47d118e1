"""Skip or fail: what a test does when the tree's code cannot import or run here.

A skip is only for what this machine genuinely lacks (an optional upstream dependency not
installed); what the port must fix (a name removed from today's torch or NumPy, an unguarded
TransformerEngine import, a name missing from rocm_port) fails, and every test that meets the
same missing package says the same one line, naming the tree's importing line.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from megaport.smoke._guard import is_blocked
from megaport.smoke._locate import import_first, in_port, tree_frame

def port_name(rocm_port, name: str):
    """``rocm_port.<name>``, or a failure: the port is rendered the same for every era (but two
    era constants), so a name missing from it is a broken port, never an era without it."""
    import pytest

    value = getattr(rocm_port, name, None)
    if value is None:
        pytest.fail(f"{rocm_port.__name__} has no {name}: the port is the same in every era, so the port "
                    f"is broken ({getattr(rocm_port, '__file__', '?')})", pytrace=False)
    return value


# The stack a ported tree must run on (Python 3.12, torch >= 2.6, NumPy 2): an API of these that
# old upstream code needs but today's release removed (torch._six, np.float, ...) is the port's to
# fix, never a dependency the user lacks.
TARGET_STACK = ("torch", "numpy")
# Imported by upstream at module level without a guard in some eras; ROCm has no
# TransformerEngine, so such an import is the port's to guard.
PORT_GUARDS = ("transformer_engine",)


def missing_import_verdict(missing: str) -> tuple[str, str]:
    """('fail' | 'skip', why) for an import of ``missing`` that failed while importing tree code.

    A skip is only for an optional dependency that is genuinely not installed; a name removed from
    an installed package of the target stack, or an unguarded TransformerEngine import, fails.
    """
    top = missing.partition(".")[0]
    if top in PORT_GUARDS:
        return "fail", (f"imports {top} without a guard: ROCm has no TransformerEngine, so the port "
                        "must guard this import")
    installed = top == "" or importlib.util.find_spec(top) is not None
    if top in TARGET_STACK or (installed and top in sys.stdlib_module_names):
        return "fail", (f"needs {missing}, which today's {top} no longer has: old upstream code the "
                        "port must update for the target stack")
    if installed:
        return "skip", f"needs a newer/different {top} than installed here"
    return "skip", f"needs {top}, an upstream dependency not installed here"


def missing_dependency(exc: BaseException, tree: Path | None = None) -> tuple[str, str] | None:
    """``(verdict, line)`` for tree code whose import of a third-party package failed: ``'skip'``
    only for an upstream dependency genuinely not installed here, ``'fail'`` for what the port must
    fix (:func:`missing_import_verdict`); None when ``exc`` is no such thing (a missing megatron
    module, a blocked module, anything but ModuleNotFoundError).

    The one reporting path for a missing upstream package: every test that meets it, in process
    or in a rank of the 2-rank run, says the same line, naming the tree's importing line, so the
    report gives one ``skipped N:`` line for it.
    """
    if not isinstance(exc, ModuleNotFoundError):
        return None
    missing = exc.name or ""
    if not missing or missing.partition(".")[0] == "megatron" or is_blocked(missing):
        return None
    verdict, why = missing_import_verdict(missing)
    return verdict, f"{why} ({(tree_frame(exc, tree) if tree is not None else '') or exc})"


def import_first_or_skip(names, what: str, tree: Path | None = None):
    """:func:`import_first`, with a missing third-party dependency judged by
    :func:`skip_or_fail_missing`: ``(module or None, why none)``."""
    try:
        return import_first(names)
    except ModuleNotFoundError as exc:
        skip_or_fail_missing(exc, what, tree)


def skip_or_fail_missing(exc: ModuleNotFoundError, what: str, tree: Path | None = None):
    """Turn a failed import of tree code into a skip only for a genuinely absent optional
    dependency (:func:`missing_dependency`'s line); what the port must fix fails, and a missing
    megatron or blocked module re-raises."""
    import pytest

    judged = missing_dependency(exc, tree)
    if judged is None:
        raise exc
    verdict, line = judged
    if verdict == "fail":
        pytest.fail(f"{what} {line}", pytrace=False)
    pytest.skip(line)


def cuda_only_reason(exc: BaseException, tree: Path) -> str | None:
    """When ``exc`` is upstream code asking for CUDA on a machine without it: why, with the place."""
    text = f"{type(exc).__name__}: {exc}"
    markers = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "No CUDA GPUs are available",
               "CUDA driver initialization failed", "no CUDA-capable device")
    where = tree_frame(exc, tree)
    if in_port(Path(where.partition(":")[0])):
        return None  # the port's own code must run on every device: never an era's excuse
    cuda_assert = isinstance(exc, AssertionError) and "cuda" in where.partition(": ")[2].lower()
    if not any(m in text for m in markers) and not cuda_assert:
        return None
    where = where or "upstream code"
    return f"the era's code needs a GPU here ({where}): {text}"
