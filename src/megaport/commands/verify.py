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
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megaport import device as devices
from megaport.catalogue import load_catalogue
from megaport.errors import MegaportError
from megaport.porttree import PortState, read_state
from megaport.report import write_json

DEVICE_CHOICES = ("auto", "hip", "cuda", "cpu")
MIN_PYTEST = (7, 4)
TORCH_HINT = (
    "install the torch build for your platform first (megaport never installs torch): on ROCm, "
    "ROCm's build, e.g. pip install torch --index-url https://download.pytorch.org/whl/rocm<version>; "
    "on NVIDIA, a CUDA build; elsewhere the CPU build"
)


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


def smoke_dir() -> Path:
    from megaport.smoke import SMOKE_DIR

    return SMOKE_DIR


def ported_tree(tree: Path) -> tuple[Path, PortState]:
    """The tree and its recorded state, or a usage error (exit 2)."""
    tree = tree.expanduser().absolute()
    if not tree.is_dir():
        raise MegaportError(f"{tree} is not a directory; give the ported tree (megaport apply --dest)", exit_code=2)
    state = read_state(tree)
    if state is None:
        raise MegaportError(
            f"{tree} is not a ported tree (no .git/megaport/state.json); run 'megaport apply' first", exit_code=2)
    return tree, state


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


def require_torch(info: dict, python: str) -> None:
    if not info.get("torch"):
        error = info.get("torch_error", "not importable")
        raise MegaportError(f"torch is not importable by {python} ({error}); {TORCH_HINT}", exit_code=2)


def resolve_device(requested: str, info: dict) -> str:
    """'hip', 'cuda' or 'cpu'; a requested GPU this machine cannot give fails at once (exit 2)."""
    if requested == "auto":
        return devices.device_kind(info)
    if requested == "cpu":
        return "cpu"
    build = info.get("build")
    count = len(info.get("gpus") or []) if info.get("gpu_available") else 0
    if requested == "hip":
        if build != "rocm":
            raise MegaportError(
                f"--device hip: torch {info.get('torch')} is a {build} build (torch.version.hip is None); "
                "install ROCm's torch build, or use --device auto", exit_code=2)
        if count == 0:
            raise MegaportError(
                "--device hip: torch sees no HIP GPU (torch.cuda.device_count() == 0); check that /dev/kfd and "
                "/dev/dri are accessible (render/video groups) and HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES "
                "(run 'megaport doctor')", exit_code=2)
        return "hip"
    if build == "rocm":
        raise MegaportError("--device cuda: torch is a ROCm build; use --device hip", exit_code=2)
    if build != "cuda":
        raise MegaportError(f"--device cuda: torch {info.get('torch')} is a {build} build; install a CUDA build "
                            "or use --device cpu", exit_code=2)
    if count == 0:
        raise MegaportError("--device cuda: torch sees no CUDA GPU (torch.cuda.device_count() == 0); "
                            "check the driver and CUDA_VISIBLE_DEVICES", exit_code=2)
    return "cuda"


def subprocess_env(tree: Path) -> dict:
    env = dict(os.environ)
    parts = [str(tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    # Only the plugins the suite asks for: third-party pytest plugins installed on the machine
    # (random order, xdist, timeouts...) stay out of the run.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # Never write __pycache__ into the tree (it would show up in git status): cache it in
    # megaport's home instead, unless bytecode writing is off anyway.
    if not env.get("PYTHONDONTWRITEBYTECODE") and not env.get("PYTHONPYCACHEPREFIX"):
        from megaport.store import default_home

        env["PYTHONPYCACHEPREFIX"] = str(default_home() / "pycache")
    return env


def pytest_command(python: str, tree: Path, kind: str, rows: str, series: str, results: Path,
                   junit: str | None, keyword: str | None, color: bool) -> list[str]:
    folder = smoke_dir()
    command = [
        python, "-m", "pytest", "-c", str(folder / "pytest.ini"), "--rootdir", str(folder), str(folder),
        "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short", f"--color={'yes' if color else 'no'}",
        "--megaport-tree", str(tree), "--megaport-device", kind, "--megaport-masked-rows", rows,
        "--megaport-series", series, "--megaport-results", str(results),
    ]
    if junit:
        command += [f"--junitxml={Path(junit).expanduser().absolute()}"]
    if keyword:
        command += ["-k", keyword]
    return command


def verify(options: VerifyOptions, console) -> int:
    python = options.python or sys.executable
    tree, state = ported_tree(options.tree)
    rows = era_semantics(state, options.patches)
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
                                 options.keyword, color=stream.isatty())
        console.print(f"verify {tree} ({state.series}, {state.upstream_ref} = {state.upstream_sha[:12]}) "
                      f"on {kind}: running the smoke suite under pytest")
        proc = _run_streaming(command, tree, stream)
        results = _read_results(results_file)

    code = _exit_code(proc.returncode, options.keyword)
    skipped = results["summary"].get("skipped", 0) if results is not None else 0
    if options.strict and code == 0 and skipped:
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
        write_json(options.json_file, document)
    if code == 2:
        raise MegaportError(_stopped_message(proc.returncode, options.keyword), exit_code=2)
    return code


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


def report(console, document: dict, state: PortState) -> None:
    """Device and versions, then results per file, failures with their first line, skip reasons."""
    from rich.markup import escape
    from rich.table import Table

    device = document["device"]
    table = Table(title="device and versions", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tree", escape(document["tree"]))
    table.add_row("series", f"{state.series} ({device.get('fully_masked_rows')} fully masked rows)")
    table.add_row("upstream", f"{state.upstream_ref} = {state.upstream_sha[:12]}")
    table.add_row("device", device.get("device", "?"))
    for label, value in devices.summary_rows(device):
        table.add_row(label, escape(value))
    backend = device.get("backend_default")
    if backend:
        table.add_row("backend default", f"{backend['value']} → torch '{backend['torch_backend']}' ({backend['from']})")
    for variant, info in (device.get("two_rank_runs") or {}).items():
        lib = info.get("library")
        lib_text = f", {lib[0]} {lib[1] or ''}".rstrip() if lib else ""
        table.add_row(f"2-rank run ({variant})", f"{info.get('requested')} → {info.get('initialised')}{lib_text}")
    training = device.get("training") or {}
    if training:
        table.add_row("training path", escape(f"{training.get('layer_spec')}; {training.get('ddp')}; "
                                              f"{training.get('optimizer')}"))
        for line in training.get("log") or []:
            table.add_row("port log", escape(line.removeprefix("> ROCm port: ")))
    subs = device.get("training_cpu_substitutions")
    if subs:
        table.add_row("training on CPU", "; ".join(subs))
    parity = device.get("loss_parity")
    if parity:
        table.add_row("loss vs upstream", f"max {parity['max_relative_difference']:.2e} relative over "
                                          f"{parity['steps']} steps, same seed and batches; against "
                                          f"{escape(parity.get('against', 'upstream, fusions off'))}")
    pretrain = device.get("pretrain_gpt")
    if pretrain:
        table.add_row("pretrain_gpt.py", escape(f"{pretrain['ms_per_iter']:.1f} ms/iter, {pretrain['tokens_per_s']:.0f} "
                                                f"tokens/s; loss {pretrain['losses'][0]} → {pretrain['losses'][-1]}; "
                                                f"{pretrain['data']}"))
        table.add_row("pretrain command", escape(pretrain["command"]))
    not_run = device.get("gpu_only_not_run")
    if not_run:
        table.add_row("GPU-only cases", f"{len(not_run)} not run on CPU (deselected)")
    console.print(table)

    per_file: dict = {}
    for test in document["tests"]:
        name = test["name"].split("::")[0]
        counts = per_file.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "time": 0.0})
        key = "failed" if test["outcome"] in ("failed", "error") else test["outcome"]
        counts[key] += 1
        counts["time"] += test["duration"]
    results = Table(title="smoke results", title_justify="left")
    for column in ("suite", "passed", "failed", "skipped", "seconds"):
        results.add_column(column, justify="left" if column == "suite" else "right")
    for name, counts in per_file.items():
        failed = f"[red]{counts['failed']}[/]" if counts["failed"] else "0"
        results.add_row(escape(name), str(counts["passed"]), failed, str(counts["skipped"]), f"{counts['time']:.1f}")
    console.print(results)

    failures = [t for t in document["tests"] if t["outcome"] in ("failed", "error")]
    for test in failures:
        console.print(f"[red]FAILED[/] {escape(test['name'])}: {escape(test.get('message', ''))}")
    reasons: dict = {}
    for test in document["tests"]:
        if test["outcome"] == "skipped":
            reasons.setdefault(test.get("message", ""), []).append(test["name"])
    for reason, names in reasons.items():
        console.print(f"[yellow]skipped[/] {len(names)}: {escape(reason)}")
    summary = document["summary"]
    colour = "red" if summary["failed"] else "green"
    console.print(f"[{colour}]{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped"
                  f"[/] in {summary.get('duration', 0):.1f} s on {device.get('device', '?')}")
