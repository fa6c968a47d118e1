"""Loss parity in a layout: the ported tree against its unported upstream commit with its fusions
off, both spread the same way, same seed, data and flags (:mod:`megaport.train.parity`)."""

from __future__ import annotations

import dataclasses

from megaport.train import baseline, parity
from megaport.train.checks import one_rank
from megaport.train.checks.spec import Check, Context


def compare(context: Context, family: str, layout) -> dict:
    """The ported run against the unported one in ``layout``, both from the shared start (the
    unported tree loads the checkpoint the ported one wrote, as a user moving to ROCm would)."""
    if not context.upstream_sha:
        raise RuntimeError("the tree records no upstream commit (.git/megaport/state.json)")
    run, mine = one_rank.layout_run(context, family, layout)
    unported = one_rank.shared_start(context, run).of(
        dataclasses.replace(one_rank.base_run(context, family, layout, "fusions-off"), layout=layout.name))
    base, _ = baseline.run_unported(unported, context.upstream_sha)
    compared = parity.loss_parity(mine, base)
    compared.update(against="unported upstream, fusions off, same layout and start",
                    baseline_shims=base["baseline_shims"])
    compared["problems"] = parity.parity_problems(compared, min(len(mine["losses"]), len(base["losses"])),
                                                  tolerance=one_rank.tolerance(context.tree, family, compared))
    return compared


CHECK = Check(name="upstream", summary="loss parity with unported upstream (fusions off) in the same layout",
              compare=compare, not_for=lambda layout, tree: None if layout.upstream_runs else
              "unported upstream does not train it without TE (the one-rank comparison is its yardstick)")
