"""Import smoke: every module the series touched imports, and apex & co. stay out.

The modules come from the tree's .git/megaport/state.json (``files``). Raising stand-ins for apex,
amp_C and the fused *_cuda extensions sit first on sys.path (conftest), so an import that gets
past the port's blocker fails even on a machine where apex is installed; after each test the
guard also checks sys.modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from megaport.smoke import _guard, _locate, _session, _verdicts


def _touched(config) -> list:
    """One parameter per .py file the series touched: its module name, or the path itself when it
    is no importable name (then it must compile)."""
    smoke = config.stash[_session.SMOKE_KEY]
    params = []
    for path in smoke.state.get("files", []):
        if not path.endswith(".py"):
            continue
        name = _locate.module_name(path) or path
        params.append(pytest.param(name, id=name))
    return params


def pytest_generate_tests(metafunc):
    if "touched_module" in metafunc.fixturenames:
        # Every series adds the rocm_port package: a state that lists no .py file fails its one case.
        metafunc.parametrize("touched_module", _touched(metafunc.config) or [pytest.param(None, id="none")])


def test_rocm_port_has_every_name_of_the_port(smoke, rocm_port):
    """The port is rendered the same for every era but two constants: every name of its interface
    (``__all__`` of megaport's source package, read as text, never imported) is in the tree's."""
    source = Path(_locate.__file__).resolve().parents[1] / "replacements" / "rocm_port" / "__init__.py"
    names = _port_interface(source.read_text(encoding="utf-8"))
    assert names, f"no __all__ in {source}"
    missing = [name for name in names if not hasattr(rocm_port, name)]
    assert not missing, (f"the tree's {Path(rocm_port.__file__).relative_to(smoke.tree)} lacks {', '.join(missing)} "
                         "of the port's interface: the port is broken")


def _port_interface(text: str) -> list:
    import ast

    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    return []


def test_tree_code_is_what_runs(smoke, rocm_port):
    """megatron comes from the tree under test, not from an installed megatron-core."""
    if smoke.era_has("megatron/core"):
        importlib.import_module("megatron.core")
    assert _locate.is_under(rocm_port, smoke.tree), (
        f"rocm_port was imported from {rocm_port.__file__}, not from the tree {smoke.tree}")
    module = sys.modules.get("megatron.core")
    if module is not None and getattr(module, "__file__", None):
        assert _locate.is_under(module, smoke.tree), (
            f"megatron.core was imported from {module.__file__}, not from {smoke.tree}: "
            "an installed megatron-core shadows the tree")
    assert "megaport.replacements.rocm_port" not in sys.modules, "megaport's own copy of the replacements was imported"


def _entry_package(smoke) -> str | None:
    """The package upstream's entry points import first: ``megatron.training`` (2024 on). Its
    modules and megatron.legacy.model import each other, so importing megatron.legacy.model first
    is a circular import in upstream itself, which no entry point ever does."""
    return "megatron.training" if smoke.era_has("megatron/training/__init__.py") else None


def _removed_by_the_series(smoke, path: str) -> bool:
    """Whether ``path``, missing from the work tree, is missing from the ported commit too (the
    series removed it) rather than lost from the work tree since."""
    from megaport.git import run_git

    head = smoke.state.get("head") or "HEAD"
    proc = run_git(["cat-file", "-e", f"{head}:{path}"], smoke.tree, check=False)
    return proc.returncode != 0


def _import_beside_its_siblings(name: str, file):
    """``name``, imported as its own script folder runs it: a module of a script folder (no
    ``__init__.py``: upstream's ``tools/checkpoint``, whose ``saver_core`` imports ``schema_core``
    beside it, as ``convert.py`` puts its folder first on ``sys.path``) finds its siblings."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        folder = file.parent
        if not exc.name or not (folder / f"{exc.name.partition('.')[0]}.py").is_file():
            raise
        sys.path.insert(0, str(folder))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(folder))


def test_touched_module_imports_without_apex(touched_module, smoke, torch_module):
    name = touched_module
    if name is None:
        pytest.fail("state.json lists no .py file the series touched: every series adds the rocm_port package",
                    pytrace=False)
    path = next(p for p in smoke.state["files"] if (_locate.module_name(p) or p) == name)
    if not (smoke.tree / path).is_file():
        # Nothing to import where the series removed it; a file the tree lost since fails.
        if not _removed_by_the_series(smoke, path):
            pytest.fail(f"{path}, which the series touched, is missing from the tree (git status)", pytrace=False)
        return
    if _locate.module_name(path) is None:
        # No importable name (a dash, say): it must at least compile.
        source = (smoke.tree / path).read_text(encoding="utf-8", errors="replace")
        compile(source, path, "exec")
        return
    try:
        first = _entry_package(smoke)
        if first and name != first:
            importlib.import_module(first)
        module = _import_beside_its_siblings(name, smoke.tree / path)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        where = _locate.tree_frame(exc, smoke.tree)
        if _guard.is_blocked(missing):
            pytest.fail(f"importing {name} needs {missing}, which the port blocks "
                        f"(apex/amp_C/*_cuda are not allowed): {where or exc}", pytrace=False)
        if missing.partition(".")[0] == "megatron":
            pytest.fail(f"importing {name} fails inside the tree: {exc} ({where})", pytrace=False)
        verdict, line = _verdicts.missing_dependency(exc, smoke.tree)
        if verdict == "fail":
            pytest.fail(f"importing {name} {line}", pytrace=False)
        pytest.skip(line)
    except ImportError as exc:
        culprit = exc.name or ""
        where = _locate.tree_frame(exc, smoke.tree)
        if _guard.is_blocked(culprit):
            pytest.fail(f"importing {name} reached {culprit}: {exc} ({where})", pytrace=False)
        if culprit and culprit.partition(".")[0] != "megatron":
            verdict, why = _verdicts.missing_import_verdict(culprit)
            if verdict == "fail":
                pytest.fail(f"importing {name}: {exc}; {culprit} is part of the target stack, so old "
                            f"upstream code the port must update ({where})", pytrace=False)
            pytest.skip(f"{why}: {exc}")
        pytest.fail(f"importing {name} failed: {exc} ({where})", pytrace=False)
    except RuntimeError as exc:
        where = _locate.tree_frame(exc, smoke.tree)
        if _guard.STAND_IN_MARK in str(exc):
            pytest.fail(f"importing {name} loaded a blocked module past the port's import blocker: "
                        f"{exc} ({where})", pytrace=False)
        reason = _verdicts.cuda_only_reason(exc, smoke.tree)
        if reason and not smoke.gpu:
            pytest.skip(reason)
        raise
    except AssertionError as exc:
        reason = _verdicts.cuda_only_reason(exc, smoke.tree)
        if reason and not smoke.gpu:
            pytest.skip(reason)
        raise
    assert _locate.is_under(module, smoke.tree), f"{name} came from {module.__file__}, not from the tree"
    loaded = _guard.blocked_modules_loaded()
    assert not loaded, f"after importing {name}: {', '.join(loaded)} in sys.modules"


@pytest.mark.parametrize("blocked", ["apex", "amp_C", "scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda"])
def test_import_blocker_refuses(blocked, rocm_port):
    """The tree's blocker answers first: a clean ImportError, never the installed module; and a
    probe (transformers asks ``find_spec("apex")`` at import) hears "not installed", never an exception."""
    assert importlib.util.find_spec(blocked) is None, f"find_spec({blocked!r}) found it: the port's blocker does not hide it"
    try:
        importlib.import_module(blocked)
    except ImportError as exc:
        absent = blocked in sys.modules and sys.modules[blocked] is None  # the port's absent mark
        assert absent or "rocm_port" in str(exc) or "ROCm port" in str(exc), (
            f"'import {blocked}' failed, but not by the port's blocker: {exc}")
    except RuntimeError as exc:
        assert _guard.STAND_IN_MARK not in str(exc), (
            f"'import {blocked}' reached the installed module: the port's import blocker is not active")
        raise
    else:
        pytest.fail(f"'import {blocked}' succeeded: the port's import blocker is not active", pytrace=False)
    assert sys.modules.get(blocked) is None


def test_apex_stays_out_of_a_full_megatron_core_import(smoke, rocm_port):
    """Importing the packages every era's training entry imports first (megatron.core from 2022-11;
    megatron, its models and its model-parallel package before) loads none of them."""
    names = ["megatron.core"] if smoke.era_has("megatron/core") else ["megatron", "megatron.model", "megatron.mpu"]
    for name in names:
        importlib.import_module(name)
    loaded = _guard.blocked_modules_loaded()
    assert not loaded, f"{', '.join(loaded)} loaded by importing {', '.join(names)}"
    assert Path(rocm_port.__file__).parent.name == "rocm_port", f"{rocm_port.__file__} is not the port's package"
