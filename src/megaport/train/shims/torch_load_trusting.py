"""``torch-load-trusting``: Megatron's own checkpoint loads read what they wrote, as on torch < 2.6.

Since torch 2.6 ``torch.load`` defaults to ``weights_only=True``, which refuses the
``argparse.Namespace`` (and other objects) every Megatron checkpoint holds: an unported tree from
before upstream's f574182520 (2025-03-18) cannot load its own checkpoint on today's torch. Here
torch's own switch for it, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, is set in the baseline process: a
load whose call says nothing about ``weights_only`` reads the whole pickle, as upstream's fix
chose (``weights_only=False``), while a call that asks for weights only still gets them. The port
serves the same in its own way (its checkpoint hooks pass the argument to Megatron's loads).
"""

from __future__ import annotations

import os

from megaport.train.shims._pattern import Match
from megaport.train.tree_files import tree_text

NAME = "torch-load-trusting"
DESCRIPTION = ("Megatron's checkpoint loads read their own pickles (torch's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD: "
               "weights_only=False where the call says nothing, as upstream's f574182520 chose)")
ERAS = "every tree before upstream f574182520 (2025-03-18) that loads a checkpoint, on torch >= 2.6"
REPRODUCES = "torch < 2.6's torch.load default, or upstream's f574182520"
PATTERN = (Match(("UnpicklingError",), message=r"Weights only load failed"),)
#: torch's own environment switch (torch.serialization.load reads it at each call)
SWITCH = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
#: where the era's own checkpoint loads are, newest first
CHECKPOINTING = ("megatron/training/checkpointing.py", "megatron/checkpointing.py")


def applies(tree: str) -> bool:
    """Whether the era's checkpointing has a ``torch.load`` call that says nothing of ``weights_only``:
    listed up front for an unported run that loads a checkpoint, since that era prints the refusal
    and exits (``except BaseException: print_rank_0(e); sys.exit()``), no exception left to answer
    (core 0.5 resuming the ported tree's checkpoint: "the run ... took no optimizer step")."""
    text = tree_text(tree, *CHECKPOINTING) or ""
    return any("torch.load(" in line and "weights_only" not in line for line in text.splitlines())


def install() -> None:
    os.environ[SWITCH] = "1"
