"""Import smoke: every module the series touched imports, and apex & co. stay out.

The modules come from the tree's .git/megaport/state.json (``files``). Raising stand-ins for apex,
amp_C and the fused *_cuda extensions sit first on sys.path (conftest), so an import that gets
past the port's blocker fails even on a machine where apex is installed; after each test the
guard also checks sys.modules.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from megaport.smoke import _tree


def _touched(config) -> list:
    smoke = config.stash[_tree.SMOKE_KEY]
    params = []
    for path in smoke.state.get("files", []):
        if not path.endswith(".py"):
            continue
        name = _tree.module_name(path)
        marks = []
        if name is None:
            marks.append(pytest.mark.skip(reason=f"{path} is not an importable module name"))
            name = path
        elif not (smoke.tree / path).is_file():
            marks.append(pytest.mark.skip(reason=f"{path} was removed by the series"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def pytest_generate_tests(metafunc):
    if "touched_module" in metafunc.fixturenames:
        params = _touched(metafunc.config)
        if not params:
            params = [pytest.param(None, marks=pytest.mark.skip(reason="state.json lists no .py files"), id="none")]
        metafunc.parametrize("touched_module", params)


def test_tree_code_is_what_runs(smoke, rocm_port):
    """megatron comes from the tree under test, not from an installed megatron-core."""
    if (smoke.tree / "megatron" / "core").is_dir():
        importlib.import_module("megatron.core")
    assert _tree.is_under(rocm_port, smoke.tree), (
        f"rocm_port was imported from {rocm_port.__file__}, not from the tree {smoke.tree}")
    module = sys.modules.get("megatron.core")
    if module is not None and getattr(module, "__file__", None):
        assert _tree.is_under(module, smoke.tree), (
            f"megatron.core was imported from {module.__file__}, not from {smoke.tree}: "
            "an installed megatron-core shadows the tree")
    assert "megaport.replacements.rocm_port" not in sys.modules, "megaport's own copy of the replacements was imported"


def _entry_package(tree: Path) -> str | None:
    """The package upstream's entry points import first: ``megatron.training`` (2024 on). Its
    modules and megatron.legacy.model import each other, so importing megatron.legacy.model first
    is a circular import in upstream itself, which no entry point ever does."""
    return "megatron.training" if (tree / "megatron" / "training" / "__init__.py").is_file() else None


def test_touched_module_imports_without_apex(touched_module, smoke, torch_module):
    name = touched_module
    try:
        first = _entry_package(smoke.tree)
        if first and name != first:
            importlib.import_module(first)
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        where = _tree.tree_frame(exc, smoke.tree)
        if _tree.is_blocked(missing):
            pytest.fail(f"importing {name} needs {missing}, which the port blocks "
                        f"(apex/amp_C/*_cuda are not allowed): {where or exc}", pytrace=False)
        if missing.partition(".")[0] == "megatron":
            pytest.fail(f"importing {name} fails inside the tree: {exc} ({where})", pytrace=False)
        verdict, line = _tree.missing_dependency(exc, smoke.tree)
        if verdict == "fail":
            pytest.fail(f"importing {name} {line}", pytrace=False)
        pytest.skip(line)
    except ImportError as exc:
        culprit = exc.name or ""
        where = _tree.tree_frame(exc, smoke.tree)
        if _tree.is_blocked(culprit):
            pytest.fail(f"importing {name} reached {culprit}: {exc} ({where})", pytrace=False)
        if culprit and culprit.partition(".")[0] != "megatron":
            verdict, why = _tree.missing_import_verdict(culprit)
            if verdict == "fail":
                pytest.fail(f"importing {name}: {exc}; {culprit} is part of the target stack, so old "
                            f"upstream code the port must update ({where})", pytrace=False)
            pytest.skip(f"{why}: {exc}")
        pytest.fail(f"importing {name} failed: {exc} ({where})", pytrace=False)
    except RuntimeError as exc:
        where = _tree.tree_frame(exc, smoke.tree)
        if _tree.STAND_IN_MARK in str(exc):
            pytest.fail(f"importing {name} loaded a blocked module past the port's import blocker: "
                        f"{exc} ({where})", pytrace=False)
        reason = _tree.cuda_only_reason(exc, smoke.tree)
        if reason and not smoke.gpu:
            pytest.skip(reason)
        raise
    except AssertionError as exc:
        reason = _tree.cuda_only_reason(exc, smoke.tree)
        if reason and not smoke.gpu:
            pytest.skip(reason)
        raise
    assert _tree.is_under(module, smoke.tree), f"{name} came from {module.__file__}, not from the tree"
    loaded = _tree.blocked_modules_loaded()
    assert not loaded, f"after importing {name}: {', '.join(loaded)} in sys.modules"


@pytest.mark.parametrize("blocked", ["apex", "amp_C", "scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda"])
def test_import_blocker_refuses(blocked, rocm_port):
    """The tree's blocker answers first: a clean ImportError, never the installed module."""
    try:
        importlib.import_module(blocked)
    except ImportError as exc:
        assert "rocm_port" in str(exc) or "ROCm port" in str(exc), f"'import {blocked}' failed, but not by the port's blocker: {exc}"
    except RuntimeError as exc:
        assert _tree.STAND_IN_MARK not in str(exc), (
            f"'import {blocked}' reached the installed module: the port's import blocker is not active")
        raise
    else:
        pytest.fail(f"'import {blocked}' succeeded: the port's import blocker is not active", pytrace=False)
    assert blocked not in sys.modules


def test_apex_stays_out_of_a_full_megatron_core_import(smoke, rocm_port):
    """Importing the packages every era's training entry imports first (megatron.core from 2022-11;
    megatron, its models and its model-parallel package before) loads none of them."""
    names = ["megatron.core"] if (smoke.tree / "megatron" / "core").is_dir() else ["megatron", "megatron.model",
                                                                                   "megatron.mpu"]
    for name in names:
        importlib.import_module(name)
    loaded = _tree.blocked_modules_loaded()
    assert not loaded, f"{', '.join(loaded)} loaded by importing {', '.join(names)}"
    assert Path(rocm_port.__file__).name == "rocm_port.py"
