"""Loss parity can fail: a planted fault in the grad norm, the clipping or the optimizer step of a
ported tree makes ``megaport verify``'s parity test fail, and nothing else.

Before parity compared the grad norm over a window where the model learns, a 100x grad norm in the
port's ``amp_C`` passed it (the loss moved 0.5 % in the whole window). Each fault here is one line
of the ported tree (tests/support/faults.py); the baseline, unported upstream, never sees it.

- CI (Python 3.12): a tree ported from PyPI's megatron-core 0.19, trained through upstream's own
  argument parser and megatron.core (the harness).
- With a full upstream clone (MEGAPORT_UPSTREAM_CLONE): a 2022 tree through its own
  ``pretrain_gpt.py``, whose apex the port's stand-ins serve.
"""

from __future__ import annotations

import json

import pytest
from support.faults import FAULTS, plant
from support.porting import assert_clean, port

from test_verify import apply, outcomes, run_verify

PARITY_TEST = "test_loss_matches_unported_upstream_with_fusions_off[gpt]"
pytest.importorskip("torch")


def _verify_parity(tree, tmp_path) -> dict:
    report = tmp_path / "verify.json"
    proc = run_verify(str(tree), "--device", "cpu", "--json", str(report), "-k", "training", timeout=1500)
    assert report.is_file(), proc.stdout[-4000:] + proc.stderr[-2000:]
    document = json.loads(report.read_text())
    return {"exit": proc.returncode, "tests": outcomes(document), "parity": document["device"].get("loss_parity")}


def _assert_caught(result: dict, fault: str) -> None:
    tests = result["tests"]
    assert result["exit"] != 0, f"verify was green with the {fault} fault planted ({FAULTS[fault].what})"
    assert tests[PARITY_TEST]["outcome"] == "failed", tests[PARITY_TEST]
    # The training itself still ran and its loss fell: only the comparison can see the fault.
    assert tests["test_trains_through_upstreams_entry_point_with_the_example_flags[gpt]"]["outcome"] == "passed"


@pytest.mark.upstream
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_parity_catches_a_planted_fault_on_a_pypi_tree(core_upstream_py312, tmp_path, fault):
    tree = apply(core_upstream_py312, "0.19.2", tmp_path / "tree")
    plant(tree, fault)
    _assert_caught(_verify_parity(tree, tmp_path), fault)


@pytest.mark.fullclone
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_parity_catches_a_planted_fault_through_pretrain_gpt(full_clone, tmp_path, fault):
    tree = tmp_path / "tree"
    code, report, output = port(full_clone, "8df49e72a969387786cd45d63cdc9f937ff8c8a0", tree)  # main, 2022-07
    assert code == 0, output
    assert_clean(report)
    plant(tree, fault)
    _assert_caught(_verify_parity(tree, tmp_path), fault)
