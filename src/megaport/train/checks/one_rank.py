"""A layout matches one rank from the same checkpoint: upstream's own yardstick for a layout.

Two layouts with the same seed differ from their first iteration (TP2 and TP1 by 0.5 % even with
``--use-cpu-initialization`` on main: each initialises its shards its own way), so each side
starts from one checkpoint instead: one rank trains two iterations and saves its weights; a
one-rank reference and the layout both load them (``--finetune --no-load-optim --no-load-rng``;
upstream's distributed checkpoint reshards them to the layout) and train on the same data with
the same global batch. Their per-iteration loss and grad norm are then compared as loss parity
compares two trees (:func:`megaport.train.parity.parity_problems`): loss within 1 %, grad norm
within 5 %, over a window in which the model measurably learns.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from megaport.train import parity, pretrain
from megaport.train.checks.spec import Check, Context
from megaport.train.layouts import registry as layouts

#: iterations compared: the window in which a run at loss parity's learning rate learns measurably
STEPS = 30
#: iterations of the run that writes the shared checkpoint: two, so a family's warm-up (Mixtral's
#: ``--lr-warmup-iters`` of a tenth, at least one) stays shorter than its decay, as upstream asserts
INIT_STEPS = 2

_LOCK = threading.Lock()
#: (tree, device, family, sizes) -> (checkpoint folder, the one-rank reference run), made once a session
_REFERENCES: dict = {}


def _base_run(context: Context, family: str, layout) -> pretrain.Run:
    run = parity.parity_run(context.tree, "ported", gpu=context.gpu, family=family)
    return dataclasses.replace(run, sizes=dataclasses.replace(layout.sizes(run.sizes), steps=STEPS))


def reference(context: Context, run: pretrain.Run) -> tuple:
    """The checkpoint every layout of ``run``'s family and sizes starts from, and the one-rank run
    from it: (folder, run document), made once per session."""
    key = (context.tree, run.device, run.family, dataclasses.astuple(run.sizes))
    with _LOCK:
        if key not in _REFERENCES:
            folder = os.path.join(context.workdir, f"checkpoint-{run.family}-{len(_REFERENCES)}")
            first = dataclasses.replace(run, sizes=dataclasses.replace(run.sizes, steps=INIT_STEPS), save=folder)
            pretrain.run_pretrain(first, context.env)
            _REFERENCES[key] = folder, pretrain.run_pretrain(dataclasses.replace(run, load=folder), context.env)
        return _REFERENCES[key]


def compare(context: Context, family: str, layout) -> dict:
    """The layout's run against the one-rank run, both from one checkpoint."""
    run = _base_run(context, family, layout)
    folder, one = reference(context, run)
    mine = pretrain.run_pretrain(dataclasses.replace(run, layout=layout.name, load=folder), context.env)
    compared = parity.loss_parity(mine, one)
    compared.update(against="one rank from the same checkpoint", run=_kept(mine))
    compared["problems"] = parity.parity_problems(compared, min(len(mine["losses"]), len(one["losses"])))
    return compared


def _kept(document: dict) -> dict:
    """What the report keeps of a run: its command, notes, speed and what the port said."""
    return {k: document[k] for k in ("command", "notes", "ms_per_iter", "port_log", "substitutions", "losses",
                                     "grad_norms") if k in document}


CHECK = Check(name="one-rank", summary="matches one rank from the same checkpoint (loss 1 %, grad norm 5 %)",
              compare=compare, applies=lambda layout: layout is not layouts.ONE_RANK)
