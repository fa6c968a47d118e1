"""End to end on real upstream code: `megaport apply` on trees built from PyPI megatron-core.

Each release is ported as a user would (the CLI, a local upstream repo), then the ported tree is
imported in a fresh interpreter with apex/amp_C/*_cuda stand-ins on the path that crash if loaded,
and the softmax functions are compared with an fp64 reference, forward and backward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from megaport.cli import main

pytestmark = pytest.mark.upstream

E6_RELEASES = ["0.13.0", "0.13.1", "0.14.0", "0.15.0", "0.15.1", "0.15.2", "0.15.3", "0.16.0", "0.16.1"]
CHECK_SCRIPT = Path(__file__).parent / "support" / "ported_check.py"


def run_apply(*args: str):
    return CliRunner().invoke(main, ["apply", *args], catch_exceptions=False)


def ported_tree(tmp_path_factory, core_upstream, version: str) -> tuple[Path, dict]:
    dest = tmp_path_factory.mktemp("ported") / f"megatron-{version}"
    report_file = dest.parent / "report.json"
    result = run_apply("--ref", f"core_v{version}", "--repo", str(core_upstream), "--dest", str(dest),
                       "--json", str(report_file))
    assert result.exit_code == 0, result.output
    return dest, json.loads(report_file.read_text())


@pytest.fixture(scope="module", params=E6_RELEASES)
def ported(request, tmp_path_factory, core_upstream):
    return request.param, *ported_tree(tmp_path_factory, core_upstream, request.param)


def test_series_is_chosen_and_applies_without_fuzz(ported):
    version, dest, report = ported
    assert report["series"] == "core-0.13-0.16"
    assert f"megatron/core {version}" in report["reason"]
    statuses = {p["name"]: p["status"] for p in report["patches"]}
    assert all(status in ("applied", "skipped") for status in statuses.values()), statuses
    # PyPI ships megatron/core only: the training and legacy patches have nothing to change.
    skipped = [p for p in report["patches"] if p["status"] == "skipped"]
    assert {p["name"][5:9] for p in skipped} and all("tree has no megatron/" in p["reason"] for p in skipped)
    hunks = [h for p in report["patches"] for h in p["hunks"]]
    assert hunks and all(h["fuzz"] == 0 and h["outcome"] in ("exact", "offset") for h in hunks)


def test_each_patch_is_a_commit_on_the_series_branch(ported):
    _, dest, report = ported
    branch = subprocess.run(["git", "branch", "--show-current"], cwd=dest, capture_output=True, text=True).stdout
    assert branch.strip() == "megaport/core-0.13-0.16"
    log = subprocess.run(["git", "log", "--format=%s", "refs/megaport/upstream..HEAD"], cwd=dest,
                         capture_output=True, text=True).stdout.splitlines()
    applied = [p for p in report["patches"] if p["status"] == "applied"]
    assert len(log) == len(applied)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=dest, capture_output=True, text=True).stdout == ""


def test_ported_modules_import_without_apex_and_match_the_kernels(ported, fake_cuda_modules):
    version, dest, _ = ported
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(CHECK_SCRIPT), str(dest), str(fake_cuda_modules)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["blocked_loaded"] == [] and found["blocked_loaded_after"] == []
    assert {"fused_softmax", "fused_layer_norm", "tensor_parallel.layers", "optimizer"} <= set(found["imported"])
    assert found["softmax_is_port"]
    assert found["grad_accum_fusion_available"] and found["wgrad_err"] < 1e-5
    assert found["layer_norm_err"] < 1e-5
    assert isinstance(found["batch_per_block"], int) and found["batch_per_block"] > 0
    for case, result in found["softmax"].items():
        tol = 1e-5 if case.endswith("float32") else 1e-2
        assert result["dtype_kept"], case
        assert result["fwd_err"] < tol, (case, result)
        assert result["bwd_err"] < tol * 5, (case, result)
        if result["causal_zeros"] is not None:
            assert result["causal_zeros"], case
        if result["masked_row"] is not None:
            assert result["masked_row"] == [0.0, 0.0, 0.0, 0.0], case  # fully masked row → zeros


def test_rerun_is_a_noop(ported, core_upstream):
    version, dest, _ = ported
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=dest, capture_output=True, text=True).stdout
    result = run_apply("--ref", f"core_v{version}", "--repo", str(core_upstream), "--dest", str(dest))
    assert result.exit_code == 0, result.output
    assert "nothing to do" in result.output
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=dest, capture_output=True, text=True).stdout == head


def test_status_reports_the_port_offline(ported):
    version, dest, _ = ported
    result = CliRunner().invoke(main, ["status", str(dest), "--json", "-"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout[result.stdout.index("{"):])
    assert document["series"] == "core-0.13-0.16"
    assert document["upstream"]["ref"] == f"core_v{version}"
    assert document["changed_files"] == []
