"""``megaport verify``: run the smoke suite against a ported tree's own code, under pytest.

megaport itself never imports torch or Megatron: it checks the environment (a ported tree, pytest,
torch, the requested device), then starts ``python -m pytest`` on the smoke suite shipped in
``megaport.smoke`` in a fresh process, with the tree first on PYTHONPATH and options telling the
suite the tree, the device and the era's semantics (from the series' catalogue entry). pytest's own
output streams through; a rich summary and the optional JSON document come from the results file
the suite writes (see megaport/smoke/conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from megaport import device as devices
from megaport.catalogue import load_catalogue
from megaport.errors import MegaportError
from megaport.device import require_torch, resolve_device
from megaport.porttree import PortState, ported_tree, subprocess_env
from megaport.report import write_json

DEVICE_CHOICES = ("auto", "hip", "cuda", "cpu")
MIN_PYTEST = (7, 4)


@dataclass
class VerifyOptions:
    tree: Path
    device: str = "auto"
    json_file: str | None = None
    junit_file: str | None = None
    keyword: str | None = None
    strict: bool = False
    patches: str | None = None
    python: str | None = None
    models: str | None = None  # model families, comma-separated (None: all the tree has)
    layouts: str | None = None  # parallel layouts, comma-separated, 'all' or 'none' (None: all the era has)
    checks: str | None = None  # what layouts are compared with (None: every check)


def smoke_dir() -> Path:
    from megaport.smoke import SMOKE_DIR

    return SMOKE_DIR


def era_semantics(state: PortState, patches: str | None) -> str:
    """'zero' or 'uniform': the fully-masked-row semantics of the tree's series, from the catalogue."""
    try:
        series = load_catalogue(patches).get(state.series)
    except MegaportError as exc:
        raise MegaportError(f"cannot tell the era's kernel semantics: {exc}", exit_code=2) from None
    if series.fully_masked_rows not in ("zero", "uniform"):
        raise MegaportError(
            f"series {series.name}: fully_masked_rows is {series.fully_masked_rows!r} in the catalogue; "
            "expected 'zero' or 'uniform'", exit_code=2)
    return series.fully_masked_rows


def require_pytest(python: str) -> None:
    if python == sys.executable:
        spec = importlib.util.find_spec("pytest")
        if spec is None:
            raise MegaportError("pytest is not installed; verify runs its smoke suite under pytest: "
                                "pip install 'pytest>=8'", exit_code=2)
        import pytest

        version = tuple(int(p) for p in pytest.__version__.split(".")[:2] if p.isdigit())
        if version < MIN_PYTEST:
            raise MegaportError(f"pytest {pytest.__version__} is too old for the smoke suite; "
                                "pip install 'pytest>=8'", exit_code=2)


def pytest_command(python: str, tree: Path, kind: str, rows: str, series: str, results: Path,
                   junit: str | None, keyword: str | None, color: bool, models: list | None = None,
                   layouts: list | None = None, checks: list | None = None) -> list[str]:
    folder = smoke_dir()
    command = [
        python, "-m", "pytest", "-c", str(folder / "pytest.ini"), "--rootdir", str(folder), str(folder),
        "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short", f"--color={'yes' if color else 'no'}",
        # One token each ('--opt=value'): pytest takes a separate value that names a directory for
        # a test path and loads that directory's conftest.py files (the DeepSpeed fork has tests/conftest.py).
        f"--megaport-tree={tree}", f"--megaport-device={kind}", f"--megaport-masked-rows={rows}",
        f"--megaport-series={series}", f"--megaport-results={results}",
    ]
    if models:
        command += [f"--megaport-models={','.join(models)}"]
    if layouts is not None:
        command += [f"--megaport-layouts={','.join(layouts) or 'none'}"]
    if checks:
        command += [f"--megaport-checks={','.join(checks)}"]
    if junit:
        command += [f"--junitxml={Path(junit).expanduser().absolute()}"]
    if keyword:
        command += ["-k", keyword]
    return command


def verify(options: VerifyOptions, console) -> int:
    python = options.python or sys.executable
    tree, state = ported_tree(options.tree)
    rows = era_semantics(state, options.patches)
    models = _families(tree, options.models)
    layouts, checks = _layouts_and_checks(options.layouts, options.checks)
    require_pytest(python)
    if options.device == "cpu" and python == sys.executable:
        # Nothing to choose: only check that torch is there (importing it here costs seconds; the
        # suite reports the versions).
        if importlib.util.find_spec("torch") is None:
            require_torch({"torch_error": "ModuleNotFoundError: No module named 'torch'"}, python)
        kind = "cpu"
    else:
        info = devices.probe_subprocess(python)
        require_torch(info, python)
        kind = resolve_device(options.device, info)
    stream = sys.stderr if options.json_file == "-" else sys.stdout

    with tempfile.TemporaryDirectory(prefix="megaport-verify-") as scratch:
        results_file = Path(scratch) / "results.json"
        command = pytest_command(python, tree, kind, rows, state.series, results_file, options.junit_file,
                                 options.keyword, color=stream.isatty(), models=models, layouts=layouts,
                                 checks=checks)
        console.print(f"verify {tree} ({state.series}, {state.upstream_ref} = {state.upstream_sha[:12]}) "
                      f"on {kind}: running the smoke suite under pytest")
        proc = _run_streaming(command, tree, stream)
        results = _read_results(results_file)

    code = _exit_code(proc.returncode, options.keyword)
    skipped = results["summary"].get("skipped", 0) if results is not None else 0
    unverified = era_unverified(results)
    if options.strict and code == 0 and (skipped or unverified):
        code = 1
    if results is not None:
        document = {
            "tree": str(tree),
            "device": results["device"],
            "tests": [{k: t[k] for k in ("name", "outcome", "duration", "message") if k in t} for t in results["tests"]],
            "summary": results["summary"],
            "strict": options.strict,
            "exit_code": code,
        }
        report(console, document, state)
        if options.strict and skipped:
            console.print(f"[red]--strict: {skipped} skipped test(s) count as failures[/]")
        if options.strict and unverified:
            console.print(f"[red]--strict: {len(unverified)} era decision(s) taken from the ported tree, not from "
                          f"the upstream commit, count as failures[/]")
        write_json(options.json_file, document)
    if code == 2:
        raise MegaportError(_stopped_message(proc.returncode, options.keyword), exit_code=2)
    return code


def _families(tree: Path, requested: str | None) -> list | None:
    """The model families to train: ``requested`` checked against the registry and the tree (a
    one-line error for an unknown name or one the tree lacks); None (the suite's default, every
    family the tree has) when none was asked for. The tree is only read for a request: its
    default families are decided inside the suite."""
    if not requested:
        return None
    from megaport.train.families import registry

    return [f.name for f in registry.select(str(tree), requested)]


def _layouts_and_checks(layouts: str | None, checks: str | None) -> tuple:
    """The layouts and checks asked for, by name (a one-line error for an unknown one); None for
    layouts where none were named (the suite's default: every layout the era has)."""
    from megaport.train.checks import registry as check_registry
    from megaport.train.layouts import registry as layout_registry

    chosen = None if layouts is None else [layout.name for layout in layout_registry.select(layouts)]
    return chosen, [check.name for check in check_registry.select(checks)] if checks else None


def era_unverified(results: dict | None) -> list[str]:
    """The era decisions of the run (a test deselected as "not in this era", the wgrad-fusion
    expectation) that the suite took from the ported tree because the unported upstream commit
    could not be read: ``--strict`` counts each as a failure, as it counts a skip."""
    if results is None:
        return []
    return list((results.get("device") or {}).get("era_unverified") or [])


def _run_streaming(command: list[str], tree: Path, stream) -> subprocess.CompletedProcess:
    """Run pytest with its output going straight to ``stream`` (or relayed, when it has no fd)."""
    try:
        stream.flush()
        stream.fileno()
        direct = True
    except (AttributeError, OSError, ValueError):
        direct = False
    if direct:
        return subprocess.run(command, cwd=str(tree), env=subprocess_env(tree), stdout=stream, stderr=stream,
                              stdin=subprocess.DEVNULL, check=False)
    proc = subprocess.Popen(command, cwd=str(tree), env=subprocess_env(tree), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace")
    for line in proc.stdout:
        stream.write(line)
    proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode)


def _read_results(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _exit_code(pytest_code: int, keyword: str | None) -> int:
    """pytest 0 → 0; 1 (tests failed) → 1; anything else (no tests, usage, internal) → 2."""
    if pytest_code in (0, 1):
        return pytest_code
    return 2


def _stopped_message(pytest_code: int, keyword: str | None) -> str:
    if pytest_code == 5:
        return f"no smoke test matches -k {keyword!r}" if keyword else "the smoke suite collected no tests"
    if pytest_code == 4:
        return "pytest rejected the command line (see its message above)"
    if pytest_code == 2:
        return "pytest was interrupted or could not collect the smoke suite (see its output above)"
    return f"pytest stopped with exit code {pytest_code} (see its output above)"


def family_row(facts: dict) -> str:
    """One family's training in a line: entry point, flags' source, iterations, loss parity, shims."""
    training = facts.get("training") or {}
    notes = training.get("notes") or []
    source = facts.get("flags_from") or (notes[0].removeprefix("flags of ").split(", changed in")[0] if notes else "?")
    text = f"{facts.get('entry_point', '?')}, flags of {source}"
    if "error" in facts:
        return f"{text}: did not train: {facts['error']}"
    losses = facts.get("training_losses") or []
    text += f"; {len(losses)} iterations" + (f", loss {losses[0]} → {losses[-1]}" if losses else "")
    parity = facts.get("loss_parity")
    if parity is None:
        return text + ("; parity not run: " + facts["parity_error"] if "parity_error" in facts else "; parity not run")
    norms = (f", grad norm {parity['grad_norm_max_relative_difference']:.1e}"
             if parity.get("grad_norm_compared") else "")
    verdict = "holds" if not parity.get("problems") else "FAILS: " + parity["problems"][0].splitlines()[0]
    from megaport.train.parity import loss_change

    return (text + f"; parity {verdict} (loss {parity['max_relative_difference']:.1e}{norms} over "
            f"{len(parity['iterations'])}, upstream's {loss_change(parity['loss_drop'])}); baseline shims: "
            + shim_names(parity.get("baseline_shims")))


def shim_names(described) -> str:
    """The baseline shims a comparison with unported upstream needed, by name (a run records each by
    its description), or "none"."""
    from megaport.train.shims.registry import REGISTRY

    names = {shim.DESCRIPTION: name for name, shim in REGISTRY.items()}
    return ", ".join(names.get(s, s) for s in described or []) or "none"


def report(console, document: dict, state: PortState) -> None:
    """Device and versions, then results per file, failures with their first line, skip reasons."""
    console.print(_device_table(document, state))
    console.print(_results_table(document["tests"]))
    for line in _failure_lines(document["tests"]):
        console.print(line)
    for line in _skip_lines(document["tests"]):
        console.print(line)
    console.print(_summary_line(document))


def _device_table(document: dict, state: PortState):
    """The "device and versions" table: each section of DEVICE_SECTIONS adds its rows, in order."""
    table = Table(title="device and versions", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for section in DEVICE_SECTIONS:
        for label, text in section(document, state):
            table.add_row(label, text)
    return table


# Each section gives (label, text) rows of the device table; text is rich markup (escaped where it
# holds values from the run).


def _run_rows(document: dict, state: PortState):
    """The tree, its series and upstream commit, and the device the suite ran on."""
    device = document["device"]
    yield "tree", escape(document["tree"])
    yield "series", f"{state.series} ({device.get('fully_masked_rows')} fully masked rows)"
    yield "upstream", f"{state.upstream_ref} = {state.upstream_sha[:12]}"
    yield "device", device.get("device", "?")


def _environment_rows(document: dict, state: PortState):
    """Python, torch and the GPUs (the rows verify shares with bench and doctor)."""
    for label, value in devices.summary_rows(document["device"]):
        yield label, escape(value)


def _backend_rows(document: dict, state: PortState):
    """The tree's backend default, and what each 2-rank run asked for and got."""
    device = document["device"]
    backend = device.get("backend_default")
    if backend:
        yield "backend default", f"{backend['value']} → torch '{backend['torch_backend']}' ({backend['from']})"
    for variant, info in (device.get("two_rank_runs") or {}).items():
        lib = info.get("library")
        lib_text = f", {lib[0]} {lib[1] or ''}".rstrip() if lib else ""
        yield f"2-rank run ({variant})", f"{info.get('requested')} → {info.get('initialised')}{lib_text}"
    if device.get("two_rank_device_not_run"):
        yield "2-rank run (device) not run", escape(device["two_rank_device_not_run"])


def _training_rows(document: dict, state: PortState):
    """How the training test trained (the tree's pretrain_gpt.py, or the harness), and what the port logged."""
    device = document["device"]
    training = device.get("training") or {}
    if training.get("entry_point") == "pretrain_gpt.py":
        yield from _pretrain_rows(device, training)
    elif training:
        yield "training path", escape(f"megaport's harness on upstream's builders: {training.get('layer_spec')}; "
                                      f"{training.get('ddp')}; {training.get('optimizer')}")
    for line in training.get("port_log") or training.get("log") or []:
        yield "port log", escape(line.removeprefix("> ROCm port: "))


def _pretrain_rows(device: dict, training: dict):
    """The tree's pretrain_gpt.py: speed and losses, the flags as changed, the command."""
    losses = device.get("training_losses") or []
    yield "training", escape(f"the tree's pretrain_gpt.py: {training['ms_per_iter']:.1f} ms/iter, "
                             f"{training['tokens_per_s']:.0f} tokens/s; loss {losses[0]} → {losses[-1]} "
                             f"over {len(losses)} logged iterations; {training['data']}"
                             if losses else "the tree's pretrain_gpt.py")
    for note in training.get("notes") or []:
        yield "training flags", escape(note)
    yield "training command", escape(training["command"])


def _cpu_rows(document: dict, state: PortState):
    """The CPU substitutions: the training run's, and the suite's own checks'."""
    device = document["device"]
    subs = device.get("training_cpu_substitutions")
    if subs:
        yield "training on CPU", escape("; ".join(subs))
    for line in device.get("cpu_check_substitutions") or []:
        yield "checks on CPU", escape(line)


def _family_rows(document: dict, state: PortState):
    """One row a model family, where the tree has any beyond the headline one (GPT, whose facts
    have rows of their own)."""
    from megaport.train.families import registry

    families = document["device"].get("families") or {}
    if any(name not in registry.FAMILIES or not registry.FAMILIES[name].headline for name in families):
        for name, facts in families.items():
            yield f"family {name}", escape(family_row(facts))


def layout_row(checks: dict) -> str:
    """One family in one layout: each check's verdict and figures (and, against unported upstream, the
    shims it needed), and what the port said."""
    from megaport.train.checks import registry as check_registry

    parts = []
    for name, compared in checks.items():
        if "error" in compared:
            parts.append(f"{name}: did not train: {compared['error']}")
            continue
        verdict = "holds" if not compared.get("problems") else "FAILS: " + compared["problems"][0].splitlines()[0]
        shims = f"; baseline shims: {shim_names(compared['baseline_shims'])}" if "baseline_shims" in compared else ""
        parts.append(f"vs {compared.get('against', name)} {verdict} ({check_registry.CHECKS[name].figures(compared)}{shims})")
    return "; ".join(parts)


def _layout_rows(document: dict, state: PortState):
    """One row a family in a parallel layout, and one for what the era lacks."""
    device = document["device"]
    for family, per_layout in (device.get("layouts") or {}).items():
        for layout, checks in per_layout.items():
            yield f"{layout} {family}", escape(layout_row(checks))
    for line in device.get("layouts_absent") or []:
        yield "layout not run", escape(line)
    for why, lines in _grouped_by_why(device.get("checks_not_for") or []).items():
        yield "check not applied", escape(f"{'; '.join(lines)}: {why}")


def hf_row(compared: dict) -> str:
    """One family at one TP size brought in from Hugging Face: the two losses, or why not."""
    if "error" in compared:
        return f"did not convert or train: {compared['error']}"
    verdict = "equals" if not compared.get("problems") else "FAILS: differs from"
    return (f"loss {compared['loss']:.6f} {verdict} transformers {compared['transformers']}'s "
            f"{compared['transformers_loss']:.6f} ({compared['relative_difference']:.1e}); converted by "
            f"{compared['converter']} as "
            f"{compared['docs']} runs it")


def _hf_rows(document: dict, state: PortState):
    """One row a family and TP size whose Hugging Face weights came in, and one for each that could not."""
    device = document["device"]
    for family, per_tp in (device.get("hf_in") or {}).items():
        for tp, compared in per_tp.items():
            yield f"hf in {family} {tp}", escape(hf_row(compared))
    for line in device.get("hf_in_absent") or []:
        yield "hf in not run", escape(line)


def _grouped_by_why(lines: list) -> dict:
    """'check for family in layout: why' lines, one entry a why: why -> [check for family in layout, ...]."""
    grouped: dict = {}
    for line in lines:
        what, _, why = line.partition(": ")
        grouped.setdefault(why, []).append(what)
    return grouped


def _parity_rows(document: dict, state: PortState):
    """The loss (and grad norm) against the unported upstream commit with its fusions off."""
    parity = document["device"].get("loss_parity")
    if not parity:
        return
    shims = parity.get("baseline_shims") or []
    norms = (f", grad norm max {parity['grad_norm_max_relative_difference']:.2e}"
             if parity.get("grad_norm_compared") else "")
    drop = f"; upstream's loss fell {parity['loss_drop']:.0%} over them" if "loss_drop" in parity else ""
    yield "loss vs upstream", escape(
        f"loss max {parity['max_relative_difference']:.2e} relative{norms} over {len(parity['iterations'])} "
        f"iterations{drop}, same seed, data and flags; against "
        f"{parity.get('against', 'unported upstream, fusions off')}"
        + (f"; baseline shims: {'; '.join(shims)}" if shims else ""))


def _era_rows(document: dict, state: PortState):
    """What was not run and why: GPU-only cases on the CPU, features the era lacks, era decisions."""
    device = document["device"]
    not_run = device.get("gpu_only_not_run")
    if not_run:
        yield "GPU-only cases", f"{len(not_run)} not run on CPU (deselected)"
    absent = device.get("not_in_this_era")
    era = device.get("era_from") or "upstream"
    if absent:
        yield "not in this era", escape(", ".join(name.split("::")[-1] for name in absent)
                                        + f" ({era} has no such feature; deselected)")
    if device.get("era_wgrad_fusion") and not any("gradient_accumulation_fusion" in n for n in absent or []):
        yield "wgrad fusion", escape(device["era_wgrad_fusion"])
    for note in device.get("era_unverified") or []:
        yield "era unverified", escape(note)


DEVICE_SECTIONS = (_run_rows, _environment_rows, _backend_rows, _training_rows, _cpu_rows, _family_rows,
                   _parity_rows, _hf_rows, _layout_rows, _era_rows)


def _results_table(tests: list):
    """The "smoke results" table: passed, failed, skipped and seconds per test file."""
    results = Table(title="smoke results", title_justify="left")
    for column in ("suite", "passed", "failed", "skipped", "seconds"):
        results.add_column(column, justify="left" if column == "suite" else "right")
    for name, counts in _per_file(tests).items():
        failed = f"[red]{counts['failed']}[/]" if counts["failed"] else "0"
        results.add_row(escape(name), str(counts["passed"]), failed, str(counts["skipped"]), f"{counts['time']:.1f}")
    return results


def _per_file(tests: list) -> dict:
    """{test file: its counts and seconds}, in the order the files ran (an error counts as failed)."""
    per_file: dict = {}
    for test in tests:
        name = test["name"].split("::")[0]
        counts = per_file.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "time": 0.0})
        key = "failed" if test["outcome"] in ("failed", "error") else test["outcome"]
        counts[key] += 1
        counts["time"] += test["duration"]
    return per_file


def _failure_lines(tests: list) -> list:
    """One line a failed test (or error), with its message."""
    return [f"[red]FAILED[/] {escape(test['name'])}: {escape(test.get('message', ''))}"
            for test in tests if test["outcome"] in ("failed", "error")]


def _skip_lines(tests: list) -> list:
    """One line a skip reason, with how many tests it skipped."""
    reasons: dict = {}
    for test in tests:
        if test["outcome"] == "skipped":
            reasons.setdefault(test.get("message", ""), []).append(test["name"])
    return [f"[yellow]skipped[/] {len(names)}: {escape(reason)}" for reason, names in reasons.items()]


def _summary_line(document: dict) -> str:
    summary = document["summary"]
    colour = "red" if summary["failed"] else "green"
    return (f"[{colour}]{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped"
            f"[/] in {summary.get('duration', 0):.1f} s on {document['device'].get('device', '?')}")
