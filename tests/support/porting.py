"""Helpers for tests that port real upstream trees and check them the way a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from megaport.catalogue import load_catalogue
from megaport.cli import main

CHECK_SCRIPT = Path(__file__).parent / "ported_check.py"


def port(repo: Path, ref: str, dest: Path, *extra: str) -> tuple[int, dict, str]:
    """Run `megaport apply` and return (exit code, JSON report, output)."""
    report_file = dest.parent / f"{dest.name}.report.json"
    result = CliRunner().invoke(
        main, ["apply", "--ref", ref, "--repo", str(repo), "--dest", str(dest), "--json", str(report_file), *extra]
    )
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    return result.exit_code, report, result.output


def assert_clean(report: dict) -> None:
    """Every patch applied (or skipped for a folder the tree lacks, or already in the tree: upstream's own
    fix a series carries for the refs before it, e4-2023-09's RMSNorm mark at c294408ddd), no hunk
    that landed needed fuzz."""
    statuses = {p["name"]: p["status"] for p in report["patches"]}
    assert all(s in ("applied", "skipped", "already-applied") for s in statuses.values()), statuses
    assert any(s == "applied" for s in statuses.values())
    hunks = [h for p in report["patches"] if p["status"] == "applied" for h in p["hunks"]]
    assert all(h["fuzz"] == 0 and h["outcome"] in ("exact", "offset") for h in hunks), hunks


def semantics_of(series_name: str) -> str:
    return load_catalogue().get(series_name).fully_masked_rows


def check_tree(tree: Path, fakes: Path, semantics: str) -> dict:
    """Import the ported tree in a fresh interpreter (with crashing apex stand-ins on the path)."""
    proc = subprocess.run([sys.executable, str(CHECK_SCRIPT), str(tree), str(fakes), semantics],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_kernel_semantics(found: dict, semantics: str) -> None:
    """No blocked module loaded; the softmax functions are the port's and match the fp64 reference."""
    assert found["blocked_loaded"] == [] and found["blocked_loaded_after"] == []
    assert found["softmax_is_port"]
    assert found["layer_norm_err"] < 1e-5
    if "wgrad_err" in found:
        assert found["grad_accum_fusion_available"] and found["wgrad_err"] < 1e-5
    for case, result in found["softmax"].items():
        tol = 1e-5 if case.endswith("float32") else 1e-2
        assert result["dtype_kept"], case
        assert result["fwd_err"] < tol, (case, result)
        assert result["bwd_err"] < tol * 5, (case, result)
        if result["causal_zeros"] is not None:
            assert result["causal_zeros"], case
        if result["masked_row"] is not None:
            row = result["masked_row"]
            if semantics == "zero":
                assert row == [0.0, 0.0, 0.0, 0.0], case
            else:  # uniform row of a fully masked input: 1/sk each
                assert all(abs(v - row[0]) < 1e-3 and v > 0 for v in row), case
