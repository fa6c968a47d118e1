"""``save-plan-iobytes-once``: Megatron's save planner asks for a rank's byte objects once, as torch >= 2.4 already does.

Core 0.6 … 0.8's ``MCoreSavePlanner`` (upstream main 2024-03-13, baa76c7e79, until f0161d2400,
2024-09-05) adds a write request for each byte object (RNG state, extra states) to a non-coordinator
rank's local plan, which torch < 2.4's default plan left out. Torch 2.4 puts them in every rank's
plan itself, so each came twice, and torch's global plan refuses a byte object written twice
(``AssertionError: item.index.fqn not in md``, which reaches the training loop as
``CheckpointException ranks:dict_keys([0])`` from the plan's ``reduce_scatter``). Before core 0.9
(b972e895a4) the saver also passes the coordinator flag positionally, where torch 2.4 put
``storage_meta``, so every rank plans as a non-coordinator and one rank's save dies too: main 2024-08
(101c08e74a) writing its one-rank and DP2 + distributed-optimizer checkpoints for the cross-load
check. Here the planner adds only the byte objects its plan does not hold yet, the plan upstream's
f0161d2400 builds (every entry of the rank's state dict, once). The port serves the same in its own
way (``target_stack``, which also passes the flag by name).
"""

from __future__ import annotations

import io

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "save-plan-iobytes-once"
DESCRIPTION = ("core 0.6 … 0.8's save planner adds a non-coordinator rank's byte objects to a plan torch >= 2.4 "
               "already put them in: the ones its plan lacks added, once, as upstream's f0161d2400 plans them")
ERAS = "core 0.6 … 0.8 and main to 2024-09-05, saving a torch_dist checkpoint, on torch >= 2.4"
REPRODUCES = "torch < 2.4's local save plan, or upstream's f0161d2400"
#: torch's global plan refusing a byte object planned twice (the CheckpointException the training loop
#: sees keeps it as a rank's failure: :func:`megaport.train.failure._rank_failures`)
PATTERN = (Match(("AssertionError",), message=r"item\.index\.fqn not in md", file=r"default_planner\.py"),)
PLANNER = "megatron.core.dist_checkpointing.strategies.torch"


def asked_once(module) -> None:
    """``module.MCoreSavePlanner`` adding each byte object of its state dict its plan lacks, and no other."""
    planner = getattr(module, "MCoreSavePlanner", None)
    if planner is None or not hasattr(planner, "_add_non_coordinator_iobytes_request"):
        return
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    def _add_non_coordinator_iobytes_request(self, plan):
        held = {item.index.fqn for item in plan.items}
        for fqn, value in self.state_dict.items():
            if isinstance(value, io.BytesIO) and fqn not in held:
                plan.items.extend(_create_write_items(fqn, value))

    planner._add_non_coordinator_iobytes_request = _add_non_coordinator_iobytes_request


def install() -> None:
    after_import(PLANNER, asked_once)
