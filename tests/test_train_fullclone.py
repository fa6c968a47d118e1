"""Every era trains through its own pretrain_gpt.py, against a full upstream clone
(MEGAPORT_UPSTREAM_CLONE; the Stanford fork with MEGAPORT_STANFORD_CLONE; skipped otherwise).

For one commit per era, the Stanford fork and upstream main's newest commit: ``megaport apply``,
then the tree's own ``pretrain_gpt.py`` with the era's example flags (shrunk) on the CPU, and the
unported upstream commit with its fusions off. The loss upstream logs must fall, and loss and grad
norm match per iteration (docs/verify.md#loss-parity). Run it on the target stack (Python 3.12, torch >= 2.6, NumPy 2, no apex or
TransformerEngine; upstream's own runtime packages: see README); about 1.5 minutes an era on
2 cores.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
from support.porting import assert_clean, port

from megaport.train import baseline, parity, pretrain
from megaport.train.shims import registry

pytestmark = pytest.mark.fullclone

# One commit per era (oldest tested ref of a series in each), newest upstream main, and the fork.
ERAS = [
    ("E1", "v2.0"),
    ("E2", "v2.6"),
    ("E2-2022", "8df49e72a969387786cd45d63cdc9f937ff8c8a0"),  # 2022-07, --recompute-* renames
    ("E3", "23.06"),
    ("E4", "core_v0.5.0"),
    ("E5", "core_v0.7.0"),
    ("E6", "core_v0.16.1"),
    ("E7", "core_v0.17.0"),
    ("E8", "main"),
]


def _train_and_compare(tree: Path, sha: str) -> None:
    ported = pretrain.run_pretrain(parity.parity_run(str(tree)))
    losses = ported["losses"]
    assert len(losses) >= 10 and all(v == v for v in losses), losses
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]), losses
    assert any("process group" in s for s in ported["substitutions"])  # it ran on the CPU launcher
    upstream, shims = baseline.run_unported(parity.parity_run(str(tree), "fusions-off"), sha)
    compared = parity.loss_parity(ported, upstream)
    problems = parity.parity_problems(compared, min(len(losses), len(upstream["losses"])))
    assert not problems, "\n".join(problems)
    assert set(shims) <= set(registry.REGISTRY)
    assert upstream["baseline_port_code"] == []  # every baseline process reported, none loaded port code


@pytest.mark.parametrize("era,ref", ERAS, ids=[era for era, _ in ERAS])
def test_each_era_trains_through_its_own_pretrain_gpt(full_clone, tmp_path, era, ref):
    tree = tmp_path / "tree"
    code, report, output = port(full_clone, ref, tree)
    assert code == 0, output
    assert_clean(report)
    _train_and_compare(tree, report["sha"])


def test_the_stanford_fork_trains_like_upstream(tmp_path):
    location = os.environ.get("MEGAPORT_STANFORD_CLONE")
    if not location or not Path(location).exists():
        pytest.skip("set MEGAPORT_STANFORD_CLONE to a stanford-futuredata/Megatron-LM clone to run this")
    tree = tmp_path / "tree"
    code, report, output = port(Path(location), "85f95ae", tree)
    assert code == 0, output
    _train_and_compare(tree, report["sha"])
