"""A layout matches one rank from the same checkpoint: upstream's own yardstick for a layout.

Two layouts with the same seed differ from their first iteration (TP2 and TP1 by 0.5 % even with
``--use-cpu-initialization`` on main: each initialises its shards its own way), so each side
starts from one checkpoint instead: one rank trains two iterations and saves its weights; a
one-rank reference and the layout both load them (``--finetune --no-load-optim --no-load-rng``;
upstream's distributed checkpoint reshards them to the layout) and train on the same data with
the same global batch. Their per-iteration loss and grad norm are then compared as loss parity
compares two trees (:func:`megaport.train.parity.parity_problems`): loss within 1 %, grad norm
within 5 %, over a window in which the model measurably learns.

Eras before distributed checkpoints (core 0.5) write one file per (tensor, pipeline) rank, which
another layout cannot load; there both sides draw one initialisation instead
(``--use-cpu-initialization``: the full weights drawn once on the CPU, then split), and a layout
with pipeline stages, which seed their own weights, is compared with unported upstream in that
layout rather than with one rank.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from megaport.train import example, parity, pretrain, tree_files
from megaport.train.checks.spec import Check, Context
from megaport.train.layouts import registry as layouts

#: iterations compared: the window in which a run at loss parity's learning rate learns measurably
STEPS = 30
#: iterations of the run that writes the shared checkpoint: two, so a family's warm-up (Mixtral's
#: ``--lr-warmup-iters`` of a tenth, at least one) stays shorter than its decay, as upstream asserts
INIT_STEPS = 2

_LOCK = threading.Lock()
#: (tree, device, family, sizes) -> (the run as every layout starts it, its one-rank document), once a session
_REFERENCES: dict = {}


def _base_run(context: Context, family: str, layout) -> pretrain.Run:
    run = parity.parity_run(context.tree, "ported", gpu=context.gpu, family=family)
    return dataclasses.replace(run, sizes=dataclasses.replace(layout.sizes(run.sizes), steps=STEPS))


def reference(context: Context, run: pretrain.Run) -> tuple:
    """How every layout of ``run``'s family and sizes starts (``run`` loading the shared checkpoint,
    or drawing the one shared initialisation where the era cannot reshard one), and the one-rank run
    from there: (the run to spread, its one-rank document), made once per session."""
    key = (context.tree, run.device, run.family, dataclasses.astuple(run.sizes))
    with _LOCK:
        if key not in _REFERENCES:
            try:
                start = _shared_start(context, run, len(_REFERENCES))
                _REFERENCES[key] = start, pretrain.run_pretrain(start, context.env)
            except RuntimeError as exc:  # every layout of the family fails of the first cause, not of a rerun's
                _REFERENCES[key] = exc
        if isinstance(_REFERENCES[key], RuntimeError):
            raise _REFERENCES[key]
        return _REFERENCES[key]


#: what core 0.5 … 0.7's GroupedMLP says for a distributed checkpoint, which it cannot write
_GROUPED_MLP_UNSAVED = "distributed checkpointing is not supported for GroupedMLP"


def _unsaved(tree: str, family: str) -> str | None:
    """Why one rank of ``family`` cannot write a checkpoint every layout loads on ``tree``; None where it can."""
    if not reshards(tree):
        return "this era's checkpoints do not reshard"
    from megaport.train.families import registry

    if "--moe-grouped-gemm" in registry.get(family).flags(tree)[0] and tree_files.tree_says(
            tree, "megatron/core/transformer/moe/experts.py", _GROUPED_MLP_UNSAVED):
        return "this era's grouped-GEMM experts (GroupedMLP) write no distributed checkpoint"
    return None


def _shared_start(context: Context, run: pretrain.Run, number: int) -> pretrain.Run:
    """``run`` starting where every layout starts: from one rank's checkpoint (written here) where
    the era reshards it, else from ``--use-cpu-initialization``'s weights."""
    unsaved = _unsaved(context.tree, run.family)
    if unsaved:
        why = (f"every layout draws one initialisation: {unsaved}, and on the CPU the full weights are drawn once, "
               "then split")
        extra = ((("--use-cpu-initialization",), why),)
        if reshards(context.tree) and pretrain.legacy_models_by_default(context.tree):
            extra += ((("--use-mcore-models",), "the family's experts are Megatron Core's, which this era builds only "
                       "when told"),)
        return dataclasses.replace(run, extra=run.extra + extra)
    folder = os.path.join(context.workdir, f"checkpoint-{run.family}-{number}")
    pretrain.run_pretrain(dataclasses.replace(run, sizes=dataclasses.replace(run.sizes, steps=INIT_STEPS),
                                              save=folder), context.env)
    return dataclasses.replace(run, load=folder)


def reshards(tree: str) -> bool:
    """Whether the era writes a checkpoint another layout loads (upstream's distributed format:
    ``--use-dist-ckpt`` from core 0.5, ``--ckpt-format`` later)."""
    return example.parser_has(tree, "--ckpt-format") or example.parser_has(tree, "--use-dist-ckpt")


def not_for(layout, tree: str) -> str | None:
    """Why a layout cannot be compared with one rank from one checkpoint on ``tree``: none is one
    rank itself; before distributed checkpoints each (tensor, pipeline) rank reads its own file, so
    only one initialisation can be shared (``--use-cpu-initialization``: the full weights drawn
    once, then split), and pipeline stages draw their layers' weights from their own seeds."""
    if layout is layouts.ONE_RANK:
        return "one rank is the yardstick itself"
    if not reshards(tree) and "--pipeline-model-parallel-size" in layout.flags:
        return ("this era's checkpoints do not reshard and its pipeline stages seed their own weights: "
                "compared with unported upstream in the same layout")
    return None


def compare(context: Context, family: str, layout) -> dict:
    """The layout's run against the one-rank run, both from one checkpoint."""
    start, one = reference(context, _base_run(context, family, layout))
    mine = pretrain.run_pretrain(dataclasses.replace(start, layout=layout.name), context.env)
    compared = parity.loss_parity(mine, one)
    compared.update(against="one rank from the same " + ("checkpoint" if start.load else "initialisation"),
                    run=_kept(mine))
    compared["problems"] = parity.parity_problems(compared, min(len(mine["losses"]), len(one["losses"])))
    return compared


def _kept(document: dict) -> dict:
    """What the report keeps of a run: its command, notes, speed and what the port said."""
    return {k: document[k] for k in ("command", "notes", "ms_per_iter", "port_log", "substitutions", "losses",
                                     "grad_norms") if k in document}


CHECK = Check(name="one-rank", summary="matches one rank from the same checkpoint (loss 1 %, grad norm 5 %)",
              compare=compare, not_for=lambda layout, tree: not_for(layout, tree))
