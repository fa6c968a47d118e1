"""`megaport verify` end to end on trees ported from PyPI megatron-core, on CPU with gloo.

Three eras pass; three planted defects (an apex import in a touched module, a softmax backward
without the scale, -inf masking instead of -10000.0) each make verify exit 1 with a failing test
whose name says what broke. The JSON and JUnit reports must parse and agree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from megaport.cli import main

pytestmark = pytest.mark.upstream
pytest.importorskip("torch")

# (release, series): two eras of core-0.13-0.16 and one of core-0.4-0.5.
# (release, series): both ends of the newest PyPI series, the TE-unguarded era, and core 0.6,
# whose DDP takes its settings as arguments rather than a config.
ERAS = [("0.13.0", "core-0.13-0.16"), ("0.16.1", "core-0.13-0.16"), ("0.5.0", "core-0.4-0.5"),
        ("0.6.0", "core-0.6-0.7")]


def apply(core_upstream: Path, version: str, dest: Path) -> Path:
    result = CliRunner().invoke(main, ["apply", "--ref", f"core_v{version}", "--repo", str(core_upstream),
                                       "--dest", str(dest)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return dest


@pytest.fixture(scope="module")
def trees(tmp_path_factory, core_upstream):
    made: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in made:
            made[version] = apply(core_upstream, version, tmp_path_factory.mktemp("verify") / f"core-{version}")
        return made[version]

    return get


def run_verify(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real command in a fresh process, as CI runs it."""
    return subprocess.run([sys.executable, "-m", "megaport.cli", "verify", *args], capture_output=True, text=True,
                          timeout=timeout)


def outcomes(document: dict) -> dict:
    return {t["name"].split("::", 1)[1]: t for t in document["tests"]}


@pytest.mark.parametrize("version,series", ERAS, ids=[v for v, _ in ERAS])
def test_verify_passes_on_a_ported_pypi_tree(trees, tmp_path, version, series):
    tree = trees(version)
    report, junit = tmp_path / "verify.json", tmp_path / "verify.xml"
    proc = run_verify(str(tree), "--device", "cpu", "--json", str(report), "--junit", str(junit))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    document = json.loads(report.read_text())
    assert set(document) >= {"device", "tests", "summary"}
    summary = document["summary"]
    assert summary["failed"] == 0 and summary["passed"] >= 60, summary
    assert summary["passed"] + summary["failed"] + summary["skipped"] == len(document["tests"])
    assert all(set(t) >= {"name", "outcome", "duration"} for t in document["tests"])
    device = document["device"]
    assert device["series"] == series and device["device"] == "cpu" and device["torch"]
    assert device["upstream_ref"] == f"core_v{version}" and len(device["upstream_sha"]) == 40
    tests = outcomes(document)
    # Every part of the suite ran and passed where the era allows it on CPU.
    for name in ("test_import_blocker_refuses[apex]", "test_tree_code_is_what_runs",
                 "test_softmax_backward_applies_scale[0.5-causal]", "test_masked_elements_are_minus_10000_not_inf[bf16]",
                 "test_fully_masked_rows_follow_the_era[fp16]", "test_gradcheck_fp64[masked]",
                 "test_fused_scale_mask_softmax_takes_the_fused_path[bf16-causal]",
                 "test_softmax_forward_matches_fp64_reference[masked-bf16-sk-4099]",
                 "test_rocm_port_fused_adam_is_adamw", "test_weight_gradient_accumulation_matches_matmul[fp32]",
                 "test_all_reduce_is_exact[gloo]", "test_broadcast_is_exact[gloo]",
                 "test_column_parallel_linear_tp2_matches_unsharded[gloo]",
                 "test_row_parallel_linear_tp2_matches_unsharded[gloo]"):
        assert tests[name]["outcome"] == "passed", (name, tests[name])
    touched = [n for n in tests if n.startswith("test_touched_module_imports_without_apex[")]
    assert touched and all(tests[n]["outcome"] == "passed" for n in touched)
    # Upstream's training path with its default fusions, and the same losses as upstream with its
    # fusions off. 0.5.0's GPTModel imports TransformerEngine unguarded: the port's stand-in makes
    # it train too.
    for name in ("test_trains_through_upstreams_entry_point_with_the_example_flags[gpt]",
                 "test_loss_matches_unported_upstream_with_fusions_off[gpt]"):
        assert tests[name]["outcome"] == "passed", tests[name]
    losses = device["training_losses"]
    assert losses[-1] < losses[0]
    assert len(device["loss_parity"]["iterations"]) >= 10 and device["loss_parity"]["max_relative_difference"] <= 0.01
    if version != "0.5.0":  # PyPI's 0.5.0 lacks megatron/optimizer (its optimizer tests skip there)
        assert "get_megatron_optimizer" in device["training"]["optimizer"]
        assert summary["skipped"] == 0, [t for t in document["tests"] if t["outcome"] == "skipped"]
    for test in document["tests"]:  # every skip says why
        if test["outcome"] == "skipped":
            assert test.get("message"), test
    suites = ET.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    assert int(suite.get("tests")) == len(document["tests"])
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0
    assert int(suite.get("skipped")) == summary["skipped"]
    # The rich summary names the device and the series; verify never touched the tree.
    assert "smoke results" in proc.stdout and series in proc.stdout
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tree, capture_output=True, text=True).stdout == ""


# ------------------------------------------------------------------------------------------
# Planted defects
# ------------------------------------------------------------------------------------------


def plant_apex_import(tree: Path) -> None:
    path = tree / "megatron/core/fusions/fused_layer_norm.py"
    text = path.read_text()
    path.write_text(text.replace("\nimport torch\n", "\nimport torch\nimport apex  # planted defect\n", 1))
    assert "planted defect" in path.read_text()


def plant_backward_without_scale(tree: Path) -> None:
    path = tree / "megatron/core/rocm_port/softmax.py"
    text = path.read_text()
    # Both backward paths: the fp32 workspace one and the one in the input dtype.
    new = text.replace("torch.mul(gb, scale, out=work)", "work.copy_(gb)").replace(
        "        if scale != 1.0:\n            gi4.mul_(scale)\n", "")
    assert new.count("work.copy_(gb)") == 1 and "gi4.mul_(scale)" not in new
    path.write_text(new)


def plant_inf_masking(tree: Path) -> None:
    path = tree / "megatron/core/rocm_port/softmax.py"
    text = path.read_text()
    assert "MASKED_VALUE = -10000.0" in text
    path.write_text(text.replace("MASKED_VALUE = -10000.0", 'MASKED_VALUE = float("-inf")'))


PLANTS = {
    # plant: (function, -k selection to keep CI fast, failing test that must name it, words in its message)
    "apex-import": (plant_apex_import, "imports",
                    "test_touched_module_imports_without_apex[megatron.core.fusions.fused_layer_norm]", "apex"),
    "backward-without-scale": (plant_backward_without_scale, "test_softmax_",
                               "test_softmax_backward_applies_scale[0.5-masked]", "missing the scale"),
    "inf-masking": (plant_inf_masking, "masked_elements or fully_masked",
                    "test_masked_elements_are_minus_10000_not_inf[fp32]", "-inf"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_defect_fails_with_the_test_that_names_it(trees, tmp_path, plant):
    fn, selection, failing, words = PLANTS[plant]
    tree = tmp_path / "planted"
    shutil.copytree(trees("0.16.1"), tree, symlinks=True)
    fn(tree)
    report = tmp_path / "verify.json"
    proc = run_verify(str(tree), "--device", "cpu", "-k", selection, "--json", str(report))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    tests = outcomes(json.loads(report.read_text()))
    assert tests[failing]["outcome"] == "failed", tests.get(failing)
    assert words in tests[failing]["message"], tests[failing]["message"]
    failed = {n for n, t in tests.items() if t["outcome"] == "failed"}
    if plant == "backward-without-scale":
        # The forward is right: only backward tests fail, and they say why.
        assert not any(n.startswith("test_softmax_forward") for n in failed)
        assert any(n.startswith("test_softmax_backward_matches_fp64_reference") for n in failed)
    if plant == "inf-masking":
        # In this era fully masked rows are zeros either way; the -10000.0 test is what catches it.
        assert not any(n.startswith("test_fully_masked_rows") for n in failed)
    if plant == "apex-import":
        assert failed == {failing} or all("apex" in tests[n].get("message", "") for n in failed)
    assert f"FAILED {failing}" in proc.stdout or failing in proc.stdout


def test_strict_counts_a_skip_as_a_failure(trees, tmp_path):
    """PyPI's 0.5.0 has no megatron/optimizer: its optimizer tests skip, which --strict refuses."""
    tree = trees("0.5.0")
    report = tmp_path / "verify.json"
    relaxed = run_verify(str(tree), "--device", "cpu", "-k", "optimizer")
    assert relaxed.returncode == 0, relaxed.stdout[-3000:]
    proc = run_verify(str(tree), "--device", "cpu", "-k", "optimizer", "--strict", "--json", str(report))
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "--strict:" in proc.stdout and "count as failures" in proc.stdout
    document = json.loads(report.read_text())
    assert document["strict"] is True and document["exit_code"] == 1 and document["summary"]["skipped"] > 0
