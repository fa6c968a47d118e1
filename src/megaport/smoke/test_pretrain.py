"""Upstream's own entry point on the GPU: ``torchrun pretrain_gpt.py`` with the era's example flags.

Shrunk in size only (see megaport.smoke._example); mock data where the era's parser has it, else a
tiny indexed dataset written for the run. The loss logged by upstream's training loop must fall,
and ms/iter goes into the report. GPU only: upstream's loop needs CUDA (on ROCm, HIP); on the CPU
test_training.py runs upstream's parser and builders in-process instead.
"""

from __future__ import annotations

import pytest

from megaport.smoke import _gpt, _pretrain

STEPS = 30


@pytest.mark.gpu_only("upstream's training loop needs a GPU; test_training.py covers the CPU")
def test_pretrain_gpt_trains_with_the_example_flags(smoke):
    if not (smoke.tree / "pretrain_gpt.py").is_file():
        pytest.skip("the tree has no pretrain_gpt.py (a megatron-core package, not a Megatron-LM clone)")
    run = _gpt.Run(tree=str(smoke.tree), device="cuda", layers=2, hidden=256, heads=4, seq=512, batch=2,
                   steps=STEPS, warmup=5)
    try:
        result = _pretrain.run_pretrain(str(smoke.tree), run, smoke.subprocess_env())
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    smoke.facts["pretrain_gpt"] = {k: result[k] for k in ("command", "data", "notes", "ms_per_iter", "tokens_per_s")}
    smoke.facts["pretrain_gpt"]["losses"] = [round(v, 4) for v in result["losses"]]
    losses = result["losses"]
    assert len(losses) >= STEPS // 2, f"upstream logged {len(losses)} iterations with a loss of {STEPS}"
    assert all(v == v for v in losses), f"loss became NaN: {losses}"
    assert losses[-1] < 0.95 * losses[0], f"loss did not fall over {STEPS} iterations: {losses}"
