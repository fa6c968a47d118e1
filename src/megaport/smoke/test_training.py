"""Training smoke: upstream's own megatron.core training path on the ported tree, and the same
loss as upstream with its fusions turned off.

Both tests run megaport.smoke._gpt in fresh interpreters (see its docstring for what it builds:
TransformerConfig with upstream's default fusions, the layer spec of upstream's default
``--transformer-impl``, GPTModel, megatron.core's DDP and ``get_megatron_optimizer``). The
unported tree is the tree's own upstream commit (refs/megaport/upstream), exported next to it
with ``git archive``; the tree itself is not touched. CPU substitutions for upstream's CUDA-only
plumbing are listed in the report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megaport.smoke import _gpt, _tree

STEPS = 48  # fp16 runs (the example script's precision) skip their first ~16 steps to find the loss scale
PARITY = 0.01  # per-step loss, relative


def _require_gpt(smoke):
    """Eras whose megatron.core cannot build a GPTModel (before 2023) have nothing to train here."""
    if not (smoke.tree / "megatron/core/models/gpt/gpt_model.py").is_file():
        pytest.skip("this era's megatron.core has no GPTModel (the legacy model trains through pretrain_gpt.py)")


def _run(smoke, tree, mode, env):
    try:
        return _gpt.run_in_subprocess(tree, mode, env=env, steps=STEPS,
                                      device="cpu" if not smoke.gpu else "cuda")
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def ported_run(smoke):
    _require_gpt(smoke)
    document = _run(smoke, smoke.tree, "ported", smoke.subprocess_env())
    smoke.facts["training"] = {k: document[k] for k in (
        "layer_spec", "fusions", "fusions_after_config", "ddp", "optimizer", "substitutions", "log",
        "upstream_parser", "transformer_impl_default") if k in document}
    smoke.facts["training_losses"] = [round(v, 4) for v in document["losses"]]
    if document["substitutions"]:
        smoke.facts["training_cpu_substitutions"] = document["substitutions"]
    return document


def test_gpt_trains_through_upstreams_builders_with_its_default_fusions(smoke, ported_run):
    assert _tree.is_under_path(Path(ported_run["megatron_core"]), smoke.tree), (
        f"the run imported megatron.core from {ported_run['megatron_core']}, not from the tree")
    losses = ported_run["losses"]
    assert all(v == v for v in losses), f"loss became NaN: {losses}"
    assert losses[-1] < 0.95 * losses[0], f"loss did not fall over {STEPS} steps: {[round(v, 3) for v in losses]}"
    fusions = ported_run["fusions"]
    for name in ("masked_softmax_fusion", "persist_layer_norm"):
        if name in fusions:
            assert fusions[name], f"{name} was not on: the run did not use upstream's defaults"
    assert ported_run["fusions_after_config"].get("masked_softmax_fusion", True), \
        "masked_softmax_fusion was switched off: the port's softmax never ran"


def test_loss_matches_upstream_with_fusions_off(smoke, ported_run):
    sha = smoke.state.get("upstream_sha")
    if not sha:
        pytest.fail("the tree records no upstream commit (.git/megaport/state.json)", pytrace=False)
    try:
        baseline, against = _gpt.upstream_baseline(smoke.tree, sha, smoke.subprocess_env(), steps=STEPS,
                                                    device="cpu" if not smoke.gpu else "cuda")
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    ported, base = ported_run["losses"], baseline["losses"]
    assert len(ported) == len(base) >= 10
    worst = max(abs(a - b) / abs(b) for a, b in zip(ported, base))
    smoke.facts["loss_parity"] = {"steps": len(base), "max_relative_difference": worst, "against": against,
                                  "ported": [round(v, 4) for v in ported],
                                  "upstream_fusions_off": [round(v, 4) for v in base]}
    assert worst <= PARITY, (f"per-step losses differ by up to {worst:.2%} from upstream with its fusions "
                             f"off:\n ported   {ported}\n upstream {base}")
