"""Core 0.6 … 0.8's distributed-checkpoint save planner on today's torch: a save from more than one
rank, checked with torch's own local planning, deduplication and global planning (no process group
needed)."""

from __future__ import annotations

import io
import types

import pytest

from megaport.train import failure
from megaport.train.shims import registry, save_plan_iobytes_once
from tests.support import port as port_support

torch = pytest.importorskip("torch")
from torch.distributed.checkpoint.default_planner import (  # noqa: E402
    create_default_global_save_plan, create_default_local_save_plan)
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans  # noqa: E402
from torch.distributed.checkpoint.planner_helpers import _create_write_items  # noqa: E402


def _strategies_torch(fixed: bool):
    """``MCoreSavePlanner`` as core 0.6-0.8 has it, as far as its byte-object requests go."""
    module = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")

    class MCoreSavePlanner:
        def __init__(self, state_dict, is_coordinator):
            self.state_dict, self.is_coordinator = state_dict, is_coordinator

        def create_local_plan(self):
            plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
            self._add_non_coordinator_iobytes_request(plan)
            return plan

        def _add_non_coordinator_iobytes_request(self, plan):  # upstream's lines, as baa76c7e79 wrote them
            if self.is_coordinator:
                return
            for fqn, obj in self.state_dict.items():
                if isinstance(obj, io.BytesIO):
                    plan.items.extend(_create_write_items(fqn, obj))

    module.MCoreSavePlanner = MCoreSavePlanner
    if fixed:
        for step in port_support.load().after_import_steps(module.__name__):
            step(module)
    return module


def _plans(module) -> list:
    """Two TP ranks' plans: each its own shard of a weight (rank 0's the larger, so torch's
    deduplication gives the shared byte object to rank 1, as it did in core 0.6-0.7's TP2 save)."""
    shards = [torch.ones(8), torch.ones(2)]
    return [module.MCoreSavePlanner({f"weight.{rank}": shards[rank], "rng_state/shard_0.1_1.2": io.BytesIO(b"rng")},
                                    rank == 0).create_local_plan() for rank in range(2)]


def test_todays_torch_refuses_the_second_request_the_unfixed_planner_adds():
    with pytest.raises(AssertionError, match="item.index.fqn not in md"):
        create_default_global_save_plan(dedup_save_plans(_plans(_strategies_torch(fixed=False))))


def test_the_port_asks_for_each_byte_object_once_and_torch_plans_the_save():
    plans = _plans(_strategies_torch(fixed=True))
    assert [sum(i.index.fqn.startswith("rng_state") for i in p.items) for p in plans] == [1, 1]
    _, metadata = create_default_global_save_plan(dedup_save_plans(plans))  # as torch's planner does
    assert "rng_state/shard_0.1_1.2" in metadata.state_dict_metadata


def test_the_baseline_shim_answers_the_failed_global_plan_and_plans_each_byte_object_once():
    """Unported main 2024-08 (101c08e74a) saving for the cross-load check died in the global plan, which
    reaches the training loop as torch's CheckpointException holding the rank's AssertionError: the
    failure megaport records keeps it, the shim (written apart from the port) answers it, and with the
    shim torch plans the save."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        create_default_global_save_plan(dedup_save_plans(_plans(_strategies_torch(fixed=False))))
    except AssertionError as exc:
        died = failure.from_exception(CheckpointException("plan", {0: _wrap_exception(exc)}))
    assert [one.exception for one in died.chain()] == ["CheckpointException", "AssertionError"]
    assert registry.pick([died], have=()) == save_plan_iobytes_once.NAME
    module = _strategies_torch(fixed=False)
    save_plan_iobytes_once.asked_once(module)
    plans = _plans(module)
    assert [sum(i.index.fqn.startswith("rng_state") for i in p.items) for p in plans] == [1, 1]
    _, metadata = create_default_global_save_plan(dedup_save_plans(plans))
    assert "rng_state/shard_0.1_1.2" in metadata.state_dict_metadata
