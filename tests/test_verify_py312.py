"""`megaport verify --strict` on the target stack (Python 3.12) for trees ported from PyPI's
megatron-core 0.17 to 0.19, whose wheels ship upstream's megatron/training too.

There the training smoke runs upstream's own argument parser and validate_args on the GPT-3
example flags (shrunk), builds TransformerConfig with core_transformer_config_from_args, and
trains with upstream's default fusions and default --transformer-impl (TransformerEngine, which
the port serves with local layers). Nothing may fail or skip, and the losses must match the
unported upstream commit run with its fusions off.
"""

from __future__ import annotations

import json

import pytest

from test_verify import apply, outcomes, run_verify

pytestmark = pytest.mark.upstream
pytest.importorskip("torch")

# (release, series): E7 and both ends of E8.
ERAS = [("0.17.0", "core-0.17"), ("0.18.0", "core-0.18-main"), ("0.19.2", "core-0.18-main")]


@pytest.mark.parametrize("version,series", ERAS, ids=[v for v, _ in ERAS])
def test_verify_strict_trains_through_upstreams_parser(core_upstream_py312, tmp_path, version, series):
    tree = apply(core_upstream_py312, version, tmp_path / f"core-{version}")
    report = tmp_path / "verify.json"
    proc = run_verify(str(tree), "--device", "cpu", "--strict", "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    document = json.loads(report.read_text())
    summary, device = document["summary"], document["device"]
    assert summary["failed"] == 0 and summary["skipped"] == 0 and summary["passed"] >= 90, summary
    assert device["series"] == series
    tests = outcomes(document)
    for name in ("test_trains_through_upstreams_entry_point_with_the_example_flags[gpt]",
                 "test_loss_matches_unported_upstream_with_fusions_off[gpt]"):
        assert tests[name]["outcome"] == "passed", tests[name]
    training = device["training"]
    parser = training.get("upstream_parser") or {}
    assert parser.get("transformer_impl") == "transformer_engine", training
    assert "--fp16" in parser["flags"] and "--mock-data" in parser["flags"]
    assert training["fusions"]["masked_softmax_fusion"] and training["fusions"]["persist_layer_norm"]
    assert any("TransformerEngine is not installed" in line for line in training["log"])
    parity = device["loss_parity"]
    assert parity["against"] == "unported upstream, fusions off"
    assert len(parity["iterations"]) >= 10 and parity["max_relative_difference"] <= 0.01
