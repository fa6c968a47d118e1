"""A resume that trains nothing is an error, never exit 0.

Upstream before f574182520 (2025-03-18) cannot load its own checkpoints on torch >= 2.6
(``weights_only``), and such a run exits 0 having trained nothing; so may any load that goes wrong
quietly. The launcher (:mod:`megaport.train.launch`) counts this rank's optimizer steps (torch's
global step hook: upstream's optimizers, the port's FusedAdam and DeepSpeed's are all torch
optimizers) and exits non-zero when the script was given ``--load``, training was asked for, and
no step ran. A step fp16 skips for an overflow is no step: a resume of only skipped steps fails too.
"""

from __future__ import annotations

import importlib
import os

#: upstream's tracker of the last checkpoint in a ``--load`` folder (every era)
TRACKER = "latest_checkpointed_iteration.txt"
MESSAGE = ("> megaport: error: the run was given --load {load} and asked to train to iteration {iters}, but no "
           "optimizer step ran on this rank (the checkpoint did not load, or the run stopped before training)")


def _flag(argv: list, name: str) -> str | None:
    """The value of ``name`` in ``argv`` (the last one given, as argparse takes it)."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == name]
    return values[-1] if values else None


def _saved_iteration(load: str) -> int | None:
    """The iteration the tracker in ``load`` names (0 for a 'release' checkpoint); None without one."""
    try:
        with open(os.path.join(load, TRACKER), encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return 0 if text == "release" else int(text) if text.isdigit() else None


def training_asked(argv: list) -> tuple | None:
    """(the ``--load`` folder, the iterations asked) where ``argv`` resumes a run that has iterations
    left to train (``--finetune`` starts again from 0); None otherwise."""
    load, iters = _flag(argv, "--load"), _flag(argv, "--train-iters")
    if load is None or iters is None or not iters.isdigit() or "--skip-train" in argv:
        return None
    saved = None if "--finetune" in argv else _saved_iteration(load)
    return (load, int(iters)) if saved is None or saved < int(iters) else None


def count_steps() -> list:
    """A counter of this process's optimizer steps (a one-element list), from now on."""
    counter = [0]

    def counted(optimizer, args, kwargs):
        counter[0] += 1

    importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(counted)
    return counter


def trained_nothing(argv: list, steps: list) -> str | None:
    """The one-line error where ``argv`` asked to resume training and ``steps`` counted none; else None."""
    asked = training_asked(argv)
    if asked is None or steps[0]:
        return None
    return MESSAGE.format(load=asked[0], iters=asked[1])
