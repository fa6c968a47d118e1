"""Options, fixtures, the import guard and the JSON results of the smoke suite.

Run by ``megaport verify`` (see __init__.py); also runnable by hand:

    python -m pytest -c $(python -c 'import megaport.smoke as s; print(s.SMOKE_DIR)')/pytest.ini \\
        --rootdir <smoke dir> <smoke dir> --megaport-tree DIR [--megaport-device cpu]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megaport.smoke import _backend, _era, _guard, _locate, _session, _verdicts
from megaport.train.process_group import one_rank_group

DEVICES = ("cpu", "cuda", "hip")


def pytest_addoption(parser):
    group = parser.getgroup("megaport", "megaport verify")
    group.addoption("--megaport-tree", metavar="DIR", help="the ported tree to test (its code is what runs)")
    group.addoption("--megaport-device", choices=DEVICES, default="cpu", help="where tensors live")
    group.addoption("--megaport-masked-rows", choices=("zero", "uniform"), default=None,
                    help="the era's fully-masked-row semantics (the series' catalogue entry)")
    group.addoption("--megaport-series", default=None, help="series name, for the report")
    group.addoption("--megaport-results", metavar="FILE", default=None, help="write JSON results here")
    group.addoption("--megaport-models", metavar="NAMES", default=None,
                    help="model families to train, comma-separated (default: every family the tree has)")
    group.addoption("--megaport-layouts", metavar="NAMES", default=None,
                    help="parallel layouts to train, comma-separated, 'all' or 'none' (default: all the era has)")
    group.addoption("--megaport-checks", metavar="NAMES", default=None,
                    help="what each layout is compared with, comma-separated (default: every check)")


def _read_state(tree: Path) -> dict:
    path = tree / ".git" / "megaport" / "state.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def pytest_configure(config):
    if config.getoption("--megaport-tree") is None:
        raise pytest.UsageError("the smoke suite needs --megaport-tree DIR (megaport verify passes it)")
    tree = Path(config.getoption("--megaport-tree")).expanduser().resolve()
    state = _read_state(tree)
    rows = config.getoption("--megaport-masked-rows")
    if rows is None:
        rows = _masked_rows_from_catalogue(state.get("series"))
    stand_ins = _guard.write_stand_ins(Path(tempfile.mkdtemp(prefix="megaport-stand-ins-")))
    # The tree first, then the raising stand-ins, then everything installed.
    for entry in (str(stand_ins), str(tree)):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    results = config.getoption("--megaport-results")
    smoke = _session.Smoke(
        tree=tree,
        device_kind=config.getoption("--megaport-device"),
        fully_masked_rows_are_zero=rows == "zero",
        series=config.getoption("--megaport-series") or state.get("series", "?"),
        state=state,
        stand_ins=stand_ins,
        results=Path(results) if results else None,
        upstream=_era.Upstream(tree, state),
    )
    config.stash[_session.SMOKE_KEY] = smoke
    if not smoke.gpu:
        _cpu_check_substitutions(smoke)
    config.stash[_session.RESULTS_KEY] = {"tests": {}, "started": time.time(),
                                          "preloaded": _guard.blocked_modules_loaded()}


def _cpu_check_substitutions(smoke: _session.Smoke) -> None:
    """Before any tree import: what a CPU check of this tree must substitute for the whole
    session (a fork tree's import-time CUDA tensors), listed in the report."""
    if importlib.util.find_spec("torch") is None:
        return  # the torch fixture reports it
    import torch

    from megaport import cpu_substitutions

    lines = cpu_substitutions.install(torch, "fork-checks", tree=smoke.tree).lines
    if lines:
        smoke.facts["cpu_check_substitutions"] = lines


def _masked_rows_from_catalogue(series: str | None) -> str:
    from megaport.catalogue import load_catalogue

    if not series:
        raise pytest.UsageError("no --megaport-masked-rows and the tree records no series")
    return load_catalogue().get(series).fully_masked_rows


def pytest_unconfigure(config):
    from megaport.smoke import _launch

    _launch.stop_all()
    smoke = config.stash.get(_session.SMOKE_KEY, None)
    if smoke is not None:
        shutil.rmtree(smoke.stand_ins, ignore_errors=True)
        if smoke.upstream is not None:
            smoke.upstream.close()


def pytest_report_header(config):
    smoke = config.stash[_session.SMOKE_KEY]
    rows = "zero" if smoke.fully_masked_rows_are_zero else "uniform"
    return [f"megaport smoke: tree {smoke.tree}, device {smoke.device_kind}, series {smoke.series}, "
            f"fully masked rows {rows}"]


# Imports first (a broken import explains every later failure), then kernels, substitutes,
# distributed, training.
FILE_ORDER = ("test_imports.py", "test_kernels.py", "test_attention.py", "test_apex_substitutes.py",
              "test_distributed.py", "test_training.py", "test_hf_in.py", "test_layouts.py")


def _file_rank(item) -> int:
    name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return FILE_ORDER.index(name) if name in FILE_ORDER else len(FILE_ORDER)


def _in_upstream(smoke, marker) -> bool | None:
    """Whether the unported upstream commit has the marker's text in one of its paths; None when
    that commit cannot be read."""
    text, *paths = marker.args
    if smoke.upstream is None or not smoke.upstream.available:
        return None
    return any(text in (smoke.upstream.read(path) or "") for path in paths)


def _in_tree(smoke, marker) -> bool:
    """The same question of the ported tree's files: only where upstream cannot be read."""
    text, *paths = marker.args
    for path in paths:
        try:
            if text in (smoke.tree / path).read_text(encoding="utf-8", errors="replace"):
                return True
        except OSError:
            continue
    return False


def _deselect(config, items, unwanted, fact: str) -> None:
    """Take ``unwanted`` out of the run (deselected, listed in the report under ``fact``), not skipped."""
    if unwanted:
        items[:] = [item for item in items if item not in unwanted]
        config.hook.pytest_deselected(items=unwanted)
        config.stash[_session.SMOKE_KEY].facts[fact] = [item.nodeid for item in unwanted]


def _era_lacks(smoke, items) -> tuple[list, list]:
    """(items whose feature the era lacks, those of them decided from the ported tree).

    The era is the unported upstream commit (state.json's upstream_sha, read from the tree's
    git): a patch that dropped the feature from the ported file leaves the test in, and it fails.
    Only where that commit cannot be read does the ported tree decide, and ``verify --strict``
    counts each such deselection as a failure.
    """
    lacking, unverified = [], []
    for item in items:
        marker = item.get_closest_marker("in_upstream")
        if marker is None:
            continue
        has = _in_upstream(smoke, marker)
        if has is None:
            if not _in_tree(smoke, marker):
                lacking.append(item)
                unverified.append(item)
        elif not has:
            lacking.append(item)
    return lacking, unverified


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: pytest's order within each file is kept
    smoke = config.stash[_session.SMOKE_KEY]
    # A feature the era does not have (gradient-accumulation fusion before 2022-02, say) has
    # nothing to test: deselected and listed, never skipped, so a healthy tree skips nothing.
    lacking, unverified = _era_lacks(smoke, items)
    _deselect(config, items, lacking, "not_in_this_era")
    _deselect(config, items, [item for item in items if item.get_closest_marker("no_layout_runs")], "no_layout_runs")
    _deselect(config, items, [item for item in items if item.get_closest_marker("no_hf_rows")], "no_hf_rows")
    upstream = smoke.upstream
    smoke.facts["era_from"] = upstream.label if upstream.available else f"the ported tree ({upstream.why})"
    if unverified:
        smoke.facts.setdefault("era_unverified", []).extend(
            f"{item.nodeid} deselected, from the ported tree" for item in unverified)
    if smoke.gpu:
        return
    # Large cases kept off the CPU run to keep it fast are not run there at all (deselected and
    # listed in the report), rather than skipped: a CPU run of a healthy tree skips nothing.
    _deselect(config, items, [item for item in items if item.get_closest_marker("gpu_only") is not None],
              "gpu_only_not_run")


def pytest_collection_finish(session):
    """Start the 2-rank run now when its tests were collected: it imports while the rest runs."""
    smoke = session.config.stash[_session.SMOKE_KEY]
    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith("test_distributed.py") and "[gloo]" in item.nodeid for item in session.items):
        from megaport.smoke import _launch

        _launch.start(smoke, "gloo", "cpu")


@pytest.fixture(scope="session")
def smoke(request) -> _session.Smoke:
    return request.config.stash[_session.SMOKE_KEY]


@pytest.fixture(scope="session")
def torch_module():
    return pytest.importorskip("torch")


@pytest.fixture(scope="session")
def device(smoke, torch_module):
    return smoke.torch_device()


@pytest.fixture(scope="session")
def rocm_port(smoke):
    module, reason = _verdicts.import_first_or_skip(_locate.ROCM_PORT_MODULES, "the tree", smoke.tree)
    if module is None:
        pytest.fail(f"the tree has no rocm_port module ({reason}): the series did not apply")
    return module


@pytest.fixture(scope="session")
def fused_softmax(smoke, rocm_port):
    """The tree's fused_softmax module: every era has one (megatron/model/fused_softmax.py from
    v2.0), and the port's softmax runs in it, so a tree without one fails like one without rocm_port."""
    module, reason = _verdicts.import_first_or_skip(_locate.FUSED_SOFTMAX_MODULES, "the tree", smoke.tree)
    if module is None:
        pytest.fail(f"the tree has no fused_softmax module ({reason}): the port's softmax has nowhere to run",
                    pytrace=False)
    return module


@pytest.fixture(scope="session")
def process_group(smoke, torch_module, rocm_port):
    """A one-rank process group with Megatron's model-parallel state at TP=1 (training, grad norm).

    The backend comes from the tree: its --distributed-backend default through rocm_port's
    resolution on GPUs (RCCL on ROCm), gloo on CPU.
    """
    import torch.distributed as dist

    # megatron.core.parallel_state from 2022-11; megatron.mpu, with the same functions, before.
    module, reason = _verdicts.import_first_or_skip(("megatron.core.parallel_state", "megatron.mpu"), "the tree",
                                                    smoke.tree)
    if module is None:
        pytest.fail(f"the tree has no model-parallel state module ({reason})", pytrace=False)
    parallel_state = module
    name, source = _backend.distributed_backend_default(smoke.tree, smoke.upstream)
    chosen = name if smoke.gpu else "gloo"
    backend = _verdicts.port_name(rocm_port, "resolve_distributed_backend")(chosen)
    smoke.facts["process_group"] = {"tree_default": name, "default_from": source, "chosen": chosen, "torch_backend": backend}
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    undo = lambda: None  # noqa: E731
    if smoke.gpu:
        torch_module.cuda.set_device(0)
    else:
        # The groups the tree creates with an explicit nccl backend (2025's pipeline groups) are
        # gloo's on the CPU, as in the CPU training run.
        from megaport import cpu_substitutions

        undo = cpu_substitutions.install(torch_module, "process-group").undo
    try:
        with one_rank_group(dist, backend, timeout_s=120):
            try:
                parallel_state.initialize_model_parallel(1, 1)
                yield parallel_state
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        undo()


# ---------------------------------------------------------------------------------------------
# The guard: after every test, no blocked module may be in sys.modules.
# ---------------------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = set(_guard.blocked_modules_loaded())
    try:
        result = yield
    except ModuleNotFoundError as exc:
        # Tree code that needs a third-party package this machine lacks, met anywhere in a test:
        # the same one line as every other test that meets it (_verdicts.missing_dependency).
        judged = _verdicts.missing_dependency(exc, item.config.stash[_session.SMOKE_KEY].tree)
        if judged is None:
            raise
        verdict, line = judged
        if verdict == "fail":
            pytest.fail(line, pytrace=False)
        pytest.skip(line)
    loaded = sorted(set(_guard.blocked_modules_loaded()) - before)
    if loaded:
        pytest.fail(f"import guard: {', '.join(loaded)} got loaded during this test; "
                    "the port must keep apex, amp_C and the *_cuda extensions out", pytrace=False)
    return result


# ---------------------------------------------------------------------------------------------
# Results: one entry per test, written as JSON at the end for megaport verify.
# ---------------------------------------------------------------------------------------------


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:500] if crash.message else ""
    text = str(report.longrepr or "")
    return text.strip().splitlines()[-1][:500] if text.strip() else ""


# The session's config, for the report hook (which is not given it).
_CONFIG: dict = {}


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None:
        return
    tests = config.stash[_session.RESULTS_KEY]["tests"]
    entry = tests.setdefault(report.nodeid, {"name": report.nodeid, "outcome": "passed", "duration": 0.0})
    entry["duration"] += report.duration
    if report.when == "call":
        if report.failed:
            entry["outcome"] = "failed"
            entry["message"] = _message(report)
        elif report.skipped:
            entry["outcome"] = "skipped"
            entry["message"] = _message(report)
    elif report.failed:
        # setup/teardown failures are errors: the test could not run properly
        if entry["outcome"] != "failed":
            entry["outcome"] = "error"
            entry["message"] = f"{report.when}: {_message(report)}"
    elif report.skipped:
        entry["outcome"] = "skipped"
        entry["message"] = _message(report)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG["config"] = session.config


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    smoke = config.stash.get(_session.SMOKE_KEY, None)
    if smoke is None or smoke.results is None:
        return
    results = config.stash[_session.RESULTS_KEY]
    tests = list(results["tests"].values())
    for entry in tests:
        entry["duration"] = round(entry["duration"], 4)
    summary = {"passed": 0, "failed": 0, "skipped": 0}
    for entry in tests:
        key = "failed" if entry["outcome"] in ("failed", "error") else entry["outcome"]
        summary[key] = summary.get(key, 0) + 1
    summary["errors"] = sum(1 for e in tests if e["outcome"] == "error")
    summary["duration"] = round(time.time() - results["started"], 2)
    from megaport.device import probe

    device = probe()
    device.update({
        "device": smoke.device_kind,
        "tree": str(smoke.tree),
        "series": smoke.series,
        "upstream_ref": smoke.state.get("upstream_ref"),
        "upstream_sha": smoke.state.get("upstream_sha"),
        "fully_masked_rows": "zero" if smoke.fully_masked_rows_are_zero else "uniform",
        "blocked_modules_preloaded": results["preloaded"],
        **smoke.facts,
    })
    document = {"device": device, "tests": tests, "summary": summary, "pytest_exit": int(exitstatus)}
    smoke.results.parent.mkdir(parents=True, exist_ok=True)
    smoke.results.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
