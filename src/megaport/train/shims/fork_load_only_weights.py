"""``fork-load-only-weights``: Megatron-DeepSpeed's ``load_checkpoint`` finds ``load_only_weights`` False, as the fork's 38881e2d.

From the fork's merge of upstream main (9e72d571, 2023-07-04) until 38881e2d (2023-07-11)
``load_checkpoint`` read ``load_only_weights``, a parameter the merge had dropped: every resume
stopped before its first iteration. Here the module holds the name, False, which is what a call
that does not ask for weights alone gets from the fork's fix; the port fixes the same window in
its own way (``rocm_port.fork_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-load-only-weights"
DESCRIPTION = ("Megatron-DeepSpeed 2023-07-04 … 07-11: load_checkpoint reads load_only_weights as False, as the "
               "fork's 38881e2d (the merge dropped the parameter: no resume started)")
ERAS = "Megatron-DeepSpeed 9e72d571 (2023-07-04) … 38881e2d (2023-07-11)"
REPRODUCES = "the fork's 38881e2d (fix checkpoint save)"
PATTERN = (Match(("NameError",), message=r"name 'load_only_weights' is not defined", file=r"checkpointing\.py"),)


def load_only_weights_false(module) -> None:
    if "load_only_weights" not in vars(module):
        module.load_only_weights = False


def install() -> None:
    after_import("megatron.checkpointing", load_only_weights_false)
