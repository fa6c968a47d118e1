"""Loss parity in a layout: the ported tree against its unported upstream commit with its fusions
off, both spread the same way, same seed, data and flags (:mod:`megaport.train.parity`)."""

from __future__ import annotations

import dataclasses

from megaport.train import baseline, parity, pretrain
from megaport.train.checks import one_rank
from megaport.train.checks.spec import Check, Context


def compare(context: Context, family: str, layout) -> dict:
    """The ported run against the unported one in ``layout``."""
    if not context.upstream_sha:
        raise RuntimeError("the tree records no upstream commit (.git/megaport/state.json)")
    runs = {mode: dataclasses.replace(parity.parity_run(context.tree, mode, gpu=context.gpu, family=family),
                                      layout=layout.name) for mode in ("ported", "fusions-off")}
    # the one-rank check's window: a layout's parity needs no longer a run than its one-rank match
    runs = {mode: dataclasses.replace(run, sizes=dataclasses.replace(layout.sizes(run.sizes), steps=one_rank.STEPS))
            for mode, run in runs.items()}
    mine = pretrain.run_pretrain(runs["ported"], context.env)
    base, _ = baseline.run_unported(runs["fusions-off"], context.upstream_sha)
    compared = parity.loss_parity(mine, base)
    compared.update(against="unported upstream, fusions off, same layout", baseline_shims=base["baseline_shims"])
    compared["problems"] = parity.parity_problems(compared, min(len(mine["losses"]), len(base["losses"])))
    return compared


CHECK = Check(name="upstream", summary="loss parity with unported upstream (fusions off) in the same layout",
              compare=compare, not_for=lambda layout, tree: None if layout.upstream_runs else
              "unported upstream does not train it without TE (the one-rank comparison is its yardstick)")
