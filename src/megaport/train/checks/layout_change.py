"""A checkpoint written in a layout loads on one rank: the way back of a change of layout.

The one-rank check loads one rank's checkpoint in the layout (1 -> TP2, PP2, EP2); a run that moves
from 8 GPUs to 1, or resumes on fewer, goes the other way. Here the layout trains a few iterations
from the shared start and saves its weights (upstream's distributed format, which reshards); one
rank loads them (``--finetune --no-load-optim --no-load-rng``) and trains on. Its yardstick is one
rank loading what one rank saved after the same iterations from the same start: the two
checkpoints are the same model within the one-rank check's tolerances, so the two continuations
must be too (loss 1 %, grad norm 5 %, over their first :data:`CONTINUE_STEPS` iterations). A layout whose
shards were written or read back wrong (a TP shard misplaced, an expert or stage left out) starts
one rank from another model and fails. Its runs are its own: a layout that cannot write its
checkpoint fails this check alone.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

from megaport.train import parity, pretrain
from megaport.train.checks import one_rank
from megaport.train.checks.spec import Check, Context
from megaport.train.layouts import registry as layouts

#: the layouts whose checkpoint is loaded back on one rank: those that split the weights
#: themselves, one dimension each, as a move from 8 GPUs to 1 or 16 meets them
WRITTEN_BACK = ("tp2", "pp2", "ep2")
#: iterations the layout (and one rank beside it) trains before writing: past the first update of
#: every weight, short of the comparison window that follows
WRITE_STEPS = 4
#: iterations each side trains on from the checkpoint it loaded: enough to see the model it loaded
#: (one loaded wrong, or a random start, is 9 % apart in loss at the first: core 0.6-0.7's pp2 once
#: read a folder never written), short of where top-2 routing turns float rounding into other
#: experts (Mixtral's EP2 continuations parted 6.2 % in grad norm at iteration 23 of 50 on
#: main 2024-07, fp32, the loss 4.5e-4 apart)
CONTINUE_STEPS = 10
#: what upstream writes beside a checkpoint's iteration folders: which one is the newest
_TRACKER = "latest_checkpointed_iteration.txt"


def _written(context: Context, family: str, layout, sized_for) -> pretrain.Run:
    """``layout``'s run of :data:`WRITE_STEPS` from the shared start, in ``sized_for``'s sizes,
    saving its weights after them: made once a session."""
    base = one_rank.base_run(context, family, sized_for)
    start = one_rank.shared_start(context, base)
    shared_as = one_rank.key(context, base) + ("written", layout.name)
    # named by what it is shared under: layouts of the same sizes share one rank's run, and its folder
    folder = os.path.join(context.workdir, f"written-{family}-{layout.name}-{zlib.crc32(repr(shared_as).encode()):08x}")
    run = dataclasses.replace(start.of(dataclasses.replace(base, layout=layout.name)), save=folder,
                              sizes=dataclasses.replace(base.sizes, steps=WRITE_STEPS))
    one_rank.once(shared_as, lambda: pretrain.run_pretrain(run, context.env))
    if not os.path.exists(os.path.join(folder, _TRACKER)):
        raise RuntimeError(f"{layout.name}'s run wrote no checkpoint in {folder}")
    return run


def _on_one_rank(context: Context, family: str, sized_for, written: pretrain.Run) -> dict:
    """One rank's run from the weights ``written`` saved, in ``sized_for``'s sizes: made once a session."""
    base = one_rank.base_run(context, family, sized_for)
    start = one_rank.shared_start(context, base)
    run = dataclasses.replace(start.of(base), load=written.save, layout=layouts.ONE_RANK.name,
                              sizes=dataclasses.replace(base.sizes, steps=CONTINUE_STEPS))
    return one_rank.once(one_rank.key(context, base) + ("from", written.save),
                         lambda: pretrain.run_pretrain(run, context.env))


def compare(context: Context, family: str, layout) -> dict:
    """One rank from the layout's checkpoint against one rank from one rank's checkpoint."""
    written = _written(context, family, layout, layout)
    reference = _written(context, family, layouts.ONE_RANK, layout)
    back, yardstick = (_on_one_rank(context, family, layout, w) for w in (written, reference))
    compared = parity.loss_parity(back, yardstick)
    compared.update(against=f"one rank from one rank's checkpoint ({layout.name}'s and one rank's, each written "
                            f"after {WRITE_STEPS} iterations from the shared start, loaded on one rank)",
                    run={k: back[k] for k in ("command", "notes", "port_log") if k in back})
    # the first iterations decide it (a wrong load is far apart at once): the loss need not fall here
    compared["problems"] = parity.parity_problems(compared, min(len(back["losses"]), len(yardstick["losses"])),
                                                  yardstick="one rank from one rank's checkpoint", min_loss_drop=None)
    return compared


def not_for(layout, tree: str) -> str | None:
    """Why the way back is not checked for ``layout`` on ``tree``."""
    if layout.name not in WRITTEN_BACK:
        return (f"the way back is checked for the layouts that split the weights one way each "
                f"({', '.join(WRITTEN_BACK)}); the others' checkpoints are written the same way")
    if not one_rank.reshards(tree):
        return "this era's checkpoints do not reshard: another layout cannot load them"
    return None


CHECK = Check(name="layout-change", summary="the layout's checkpoint loads on one rank and trains as one rank's own "
              "(loss 1 %, grad norm 5 %)", compare=compare, not_for=not_for)
