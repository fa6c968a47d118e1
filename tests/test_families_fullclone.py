"""BERT and T5 train through their own entry points on real trees, against a full upstream clone
(MEGAPORT_UPSTREAM_CLONE; skipped otherwise), with loss parity against the unported commit with its
fusions off: the only upstream trainings that run the padding-mask softmax.

One 2022 tree (e2-2022-06: examples/pretrain_bert.sh, megatron/data's BERT and T5 datasets) and one
2025 tree (core_v0.16.1: examples/bert and examples/t5, megatron.core's datasets and models, whose
TransformerEngine layer specs the port must serve: they fail until it does, and that failure is
the finding). Llama-2 style and Mixtral train through pretrain_gpt.py on upstream main's newest
commit and core_v0.16.1. Run it on the target stack (Python 3.12, no apex or TransformerEngine); a few minutes a
family on 2 cores.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from support.porting import assert_clean, port

from megaport.train import baseline, parity, pretrain
from megaport.train.families import registry
from megaport.train.shims import registry as shims

pytestmark = pytest.mark.fullclone

TREES = [
    ("E2-2022", "8df49e72a969387786cd45d63cdc9f937ff8c8a0"),
    ("E6", "core_v0.16.1"),
    ("E8", "main"),
]


@pytest.fixture(scope="module")
def trees(full_clone, tmp_path_factory) -> dict:
    """Each tree ported once for all its families."""
    made = {}
    for era, ref in TREES:
        tree = tmp_path_factory.mktemp(era) / "tree"
        code, report, output = port(full_clone, ref, tree)
        assert code == 0, output
        assert_clean(report)
        made[era] = (tree, report["sha"])
    return made


def _train_with_parity(tree: Path, sha: str, family: str) -> None:
    assert family in [f.name for f in registry.families_for(str(tree))]
    ported = pretrain.run_pretrain(parity.parity_run(str(tree), family=family))
    assert ported["command"].split(" -m megaport.train.launch --cpu ")[1].startswith(
        registry.get(family).entry_point)
    losses = ported["losses"]
    assert len(losses) >= 10 and all(v == v for v in losses), losses
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]), losses
    upstream, names = baseline.run_unported(parity.parity_run(str(tree), "fusions-off", family=family), sha)
    compared = parity.loss_parity(ported, upstream)
    problems = parity.parity_problems(compared, min(len(losses), len(upstream["losses"])))
    assert not problems, "\n".join(problems)
    assert set(names) <= set(shims.REGISTRY)
    assert upstream["baseline_port_code"] == []


@pytest.mark.parametrize("era", ["E2-2022", "E6"])
@pytest.mark.parametrize("family", ["bert", "t5"])
def test_bert_and_t5_train_with_loss_parity(trees, era, family):
    _train_with_parity(*trees[era], family)


@pytest.mark.parametrize("era", ["E6", "E8"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_llama_and_mixtral_train_with_loss_parity(trees, era, family):
    _train_with_parity(*trees[era], family)
