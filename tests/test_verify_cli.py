"""`megaport verify` usage and environment errors (exit 2, one line), device choice, exit codes.

No upstream code needed: a directory with a recorded port state stands in for a ported tree, and
the torch probe is replaced where a test needs a machine this one is not.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megaport.cli import main
from megaport.commands import verify as verify_mod
from megaport.errors import MegaportError
from megaport.porttree import STATE_FILE, PatchRecord, PortState

CPU_INFO = {"torch": "2.13.0+cpu", "build": "cpu", "hip": None, "cuda": None, "gpu_available": False, "gpus": []}
ROCM_INFO = {"torch": "2.9.0+rocm6.4", "build": "rocm", "hip": "6.4.1", "cuda": None, "gpu_available": True,
             "gpus": [{"index": 0, "name": "AMD Instinct MI300X", "arch": "gfx942:sramecc+:xnack-", "memory_gib": 192.0}]}
ROCM_NO_GPU = {**ROCM_INFO, "gpu_available": False, "gpus": []}
CUDA_INFO = {"torch": "2.13.0+cu128", "build": "cuda", "hip": None, "cuda": "12.8", "gpu_available": True,
             "gpus": [{"index": 0, "name": "NVIDIA H100", "arch": "sm_90", "memory_gib": 80.0}]}


def fake_tree(root: Path, series: str = "core-0.13-0.16") -> Path:
    tree = root / "tree"
    (tree / ".git" / STATE_FILE).parent.mkdir(parents=True)
    state = PortState(upstream_url="file:///upstream", upstream_ref="core_v0.16.1", upstream_sha="a" * 40,
                      series=series, branch=f"megaport/{series}", head="b" * 40,
                      patches=[PatchRecord(name="0001-x.patch", sha256="0" * 64, status="applied", commit="c" * 40)],
                      files=["megatron/core/rocm_port/__init__.py"])
    (tree / ".git" / STATE_FILE).write_text(state.to_json())
    return tree


def invoke(*args):
    return CliRunner().invoke(main, ["verify", *args])


def test_not_a_ported_tree_is_a_usage_error(tmp_path):
    result = invoke(str(tmp_path))
    assert result.exit_code == 2
    assert "not a ported tree" in result.output and "megaport apply" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_missing_directory_is_a_usage_error(tmp_path):
    result = invoke(str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "not a directory" in result.output


def test_series_missing_from_the_catalogue(tmp_path):
    result = invoke(str(fake_tree(tmp_path, series="no-such-series")))
    assert result.exit_code == 2
    assert "no-such-series" in result.output and "semantics" in result.output


def test_torch_missing_gives_the_platform_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(verify_mod.devices, "probe_subprocess",
                        lambda python=None: {"torch": None, "torch_error": "ModuleNotFoundError: No module named 'torch'"})
    result = invoke(str(fake_tree(tmp_path)), "--device", "auto")
    assert result.exit_code == 2
    line = result.output.strip()
    assert line.startswith("megaport: error: torch is not importable") and "ROCm" in line and "never installs" in line


def test_torch_missing_with_device_cpu(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(verify_mod.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    result = invoke(str(fake_tree(tmp_path)), "--device", "cpu")
    assert result.exit_code == 2 and "torch is not importable" in result.output


def test_pytest_missing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(verify_mod.importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a))
    result = invoke(str(fake_tree(tmp_path)), "--device", "cpu")
    assert result.exit_code == 2 and "pip install 'pytest>=8'" in result.output


@pytest.mark.parametrize("requested,info,expected", [
    ("auto", CPU_INFO, "cpu"), ("auto", ROCM_INFO, "hip"), ("auto", CUDA_INFO, "cuda"), ("auto", ROCM_NO_GPU, "cpu"),
    ("cpu", ROCM_INFO, "cpu"), ("hip", ROCM_INFO, "hip"), ("cuda", CUDA_INFO, "cuda"),
])
def test_device_resolution(requested, info, expected):
    assert verify_mod.resolve_device(requested, info) == expected


@pytest.mark.parametrize("requested,info,words", [
    ("hip", CPU_INFO, "torch.version.hip is None"),
    ("hip", CUDA_INFO, "install ROCm's torch"),
    ("hip", ROCM_NO_GPU, "/dev/kfd"),
    ("cuda", ROCM_INFO, "use --device hip"),
    ("cuda", CPU_INFO, "cpu build"),
])
def test_unavailable_device_is_an_environment_error(requested, info, words):
    with pytest.raises(MegaportError) as err:
        verify_mod.resolve_device(requested, info)
    assert err.value.exit_code == 2 and words in str(err.value)


def test_device_hip_fails_at_once_on_this_machine(tmp_path):
    """The real probe: on a machine without a ROCm torch, --device hip stops before any test."""
    pytest.importorskip("torch")
    import torch

    if getattr(torch.version, "hip", None):
        pytest.skip("this machine has a ROCm torch")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megaport.cli", "verify", str(fake_tree(tmp_path)), "--device", "hip"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("megaport: error: --device hip:") and len(proc.stderr.strip().splitlines()) == 1
    assert "smoke" not in proc.stdout  # no test ran
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("code,expected", [(0, 0), (1, 1), (2, 2), (3, 2), (4, 2), (5, 2)])
def test_pytest_exit_codes_map_to_verify_exit_codes(code, expected):
    assert verify_mod._exit_code(code, None) == expected


def test_keyword_matching_nothing_is_a_usage_error(tmp_path):
    pytest.importorskip("torch")
    result = invoke(str(fake_tree(tmp_path)), "--device", "cpu", "-k", "no_such_test_anywhere")
    assert result.exit_code == 2
    assert "no smoke test matches -k 'no_such_test_anywhere'" in result.output


def test_pytest_command_runs_the_shipped_suite_with_the_era(tmp_path):
    command = verify_mod.pytest_command("python", tmp_path, "cpu", "uniform", "s", tmp_path / "r.json",
                                       "out.xml", "kernels", color=False)
    folder = verify_mod.smoke_dir()
    assert (folder / "pytest.ini").is_file() and (folder / "conftest.py").is_file()
    assert command[:3] == ["python", "-m", "pytest"] and str(folder) in command
    assert "-p" in command and "no:cacheprovider" in command
    assert "--megaport-masked-rows=uniform" in command
    # The tree is one token with its option: a separate value naming a directory would make pytest
    # load that directory's conftest.py files (the DeepSpeed fork has tests/conftest.py).
    assert f"--megaport-tree={tmp_path}" in command and str(tmp_path) not in command
    assert any(c.startswith("--junitxml=") and c.endswith("out.xml") for c in command)
    assert command[-2:] == ["-k", "kernels"]


def test_tree_is_first_on_the_path_and_bytecode_stays_out_of_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = verify_mod.subprocess_env(tmp_path)
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path), "/elsewhere"]
    assert env["PYTHONPYCACHEPREFIX"] and not env["PYTHONPYCACHEPREFIX"].startswith(str(tmp_path))


def test_an_unknown_model_family_is_a_one_line_usage_error(tmp_path):
    result = invoke(str(fake_tree(tmp_path)), "--device", "cpu", "--model", "gpt,bret")
    assert result.exit_code == 2
    assert "unknown model family 'bret'; known: gpt, bert, t5, llama, llama3, mixtral, deepseek" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_family_the_tree_lacks_is_a_one_line_usage_error(tmp_path):
    tree = fake_tree(tmp_path)
    (tree / "pretrain_gpt.py").write_text("")
    result = invoke(str(tree), "--device", "cpu", "--model", "bert")
    assert result.exit_code == 2
    assert "has no bert" in result.output and len(result.output.strip().splitlines()) == 1


def test_chosen_families_reach_the_suite(tmp_path):
    command = verify_mod.pytest_command("python", tmp_path, "cpu", "uniform", "s", tmp_path / "r.json", None, None,
                                       color=False, models=["gpt", "t5"])
    assert "--megaport-models=gpt,t5" in command
    assert not any(c.startswith("--megaport-models") for c in verify_mod.pytest_command(
        "python", tmp_path, "cpu", "uniform", "s", tmp_path / "r.json", None, None, color=False))


def test_the_report_gives_each_section_in_order():
    """The device table's sections, the results per file, failures, skips and the summary line, in order."""
    import io

    from rich.console import Console

    state = PortState(upstream_url="u", upstream_ref="core_v0.16.1", upstream_sha="a" * 40, series="s", branch="b",
                      head="b" * 40, patches=[], files=[])
    parity = {"max_relative_difference": 1e-3, "iterations": [1, 2], "loss_drop": 0.5}
    device = {
        "device": "cpu", **CPU_INFO, "backend_default": {"value": "nccl", "torch_backend": "gloo", "from": "args"},
        "two_rank_runs": {"gloo": {"requested": "nccl", "initialised": "gloo"}},
        "training": {"entry_point": "pretrain_gpt.py", "ms_per_iter": 1.0, "tokens_per_s": 2.0, "data": "mock",
                     "notes": ["flags of x.sh, changed in size"], "command": "torchrun x", "port_log": ["> ROCm port: p"]},
        "training_losses": [2.0, 1.0], "training_cpu_substitutions": ["gloo"], "cpu_check_substitutions": ["c"],
        "families": {"gpt": {"entry_point": "pretrain_gpt.py"}, "bert": {"entry_point": "pretrain_bert.py", "error": "e"}},
        "loss_parity": parity, "gpu_only_not_run": ["g"], "not_in_this_era": ["t.py::n"], "era_wgrad_fusion": "w",
        "era_unverified": ["u"],
    }
    tests = [{"name": "t.py::a", "outcome": "passed", "duration": 1.0},
             {"name": "t.py::b", "outcome": "failed", "duration": 1.0, "message": "broke"},
             {"name": "k.py::c", "outcome": "skipped", "duration": 0.0, "message": "why"}]
    out = io.StringIO()
    verify_mod.report(Console(file=out, width=200), {"tree": "/t", "device": device, "tests": tests,
                                                     "summary": {"passed": 1, "failed": 1, "skipped": 1}}, state)
    text = out.getvalue()
    rows = ["tree", "series", "upstream", "device", "python", "torch", "backend default", "2-rank run (gloo)",
            "training ", "training flags", "training command", "port log", "training on CPU", "checks on CPU",
            "family gpt", "family bert", "loss vs upstream", "GPU-only cases", "not in this era", "wgrad fusion",
            "era unverified"]
    labels = [f"│ {row}" for row in rows] + ["smoke results", "FAILED t.py::b: broke", "skipped 1: why",
                                            "1 passed, 1 failed, 1 skipped in 0.0 s on cpu"]
    positions = [text.find(label) for label in labels]
    assert -1 not in positions, [label for label, at in zip(labels, positions) if at == -1]
    assert positions == sorted(positions), text


@pytest.mark.parametrize("option, value, message", [
    ("--layouts", "tp2,tp3", "unknown layout 'tp3'; known: tp2, tp2-sp"),
    ("--checks", "one-rank,speed", "unknown check 'speed'; known: one-rank, upstream, tp-replicas, resume"),
])
def test_an_unknown_layout_or_check_is_a_one_line_usage_error(tmp_path, option, value, message):
    result = invoke(str(fake_tree(tmp_path)), "--device", "cpu", option, value)
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_chosen_layouts_and_checks_reach_the_suite(tmp_path):
    command = verify_mod.pytest_command("python", tmp_path, "cpu", "uniform", "s", tmp_path / "r.json", None, None,
                                       color=False, layouts=["tp2-sp", "cp2"], checks=["one-rank"])
    assert "--megaport-layouts=tp2-sp,cp2" in command and "--megaport-checks=one-rank" in command
    assert "--megaport-layouts=none" in verify_mod.pytest_command(
        "python", tmp_path, "cpu", "uniform", "s", tmp_path / "r.json", None, None, color=False, layouts=[])


def test_a_layout_row_names_the_shims_unported_upstream_needed():
    """A layout compared with unported upstream says which shims that baseline took, by name, as the
    family rows do; a check that never ran the baseline says nothing of shims."""
    from megaport.train.shims.registry import REGISTRY

    parity = {"max_relative_difference": 1e-6, "iterations": list(range(30)), "loss_drop": 0.13, "problems": []}
    row = verify_mod.layout_row({
        "upstream": {**parity, "against": "unported upstream, fusions off, same layout and start",
                     "baseline_shims": [REGISTRY["apex"].DESCRIPTION, REGISTRY["fork-pipe-transposes"].DESCRIPTION]},
        "one-rank": {**parity, "against": "one rank from the same initialisation"}})
    assert "same layout and start holds (" in row and "baseline shims: apex, fork-pipe-transposes)" in row
    assert row.count("baseline shims") == 1
