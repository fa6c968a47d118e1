"""``dp-reshardable-no-grad``: the distributed optimizer's dp_reshardable state is loaded without autograd.

From the dp_reshardable format (3d19693bc8, main 2025-08-23) upstream writes each parameter's
state back with an in-place copy into its main param; in fp32 the main param is a view of the
model's parameter, a leaf that requires grad, and autograd refuses the copy ("a view of a leaf
Variable that requires grad is being used in an in-place operation"): no fp32 run resumes with
``--use-distributed-optimizer``, with apex or without (main 2026-08, Mixtral in fp32). Here the
whole load (``load_parameter_state_from_dp_reshardable``) runs under ``torch.no_grad()``, which is
what the copy needs. The port fixes it in its own way (``rocm_port.optimizer_state``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "dp-reshardable-no-grad"
DESCRIPTION = ("main 2025-08-23 (3d19693bc8) on, fp32 with the distributed optimizer: its dp_reshardable state is "
               "copied back into main params that are views of leaves requiring grad, which autograd refuses; the "
               "load runs under no_grad")
ERAS = "main 2025-08-23 (3d19693bc8) on, fp32 with --use-distributed-optimizer"
REPRODUCES = "a load without autograd (what an fp16/bf16 run's separate fp32 main params never needed)"
PATTERN = (Match(("RuntimeError",), message=r"a view of a leaf Variable that requires grad is being used in an in-place",
                 file=r"distrib_optimizer\.py"),)


def loaded_without_autograd(module) -> None:
    import torch

    optimizer = getattr(module, "DistributedOptimizer", None)
    load = getattr(optimizer, "load_parameter_state_from_dp_reshardable", None)
    if load is None:
        return

    def load_parameter_state_from_dp_reshardable(self, *args, **kwargs):
        with torch.no_grad():
            return load(self, *args, **kwargs)

    optimizer.load_parameter_state_from_dp_reshardable = load_parameter_state_from_dp_reshardable


def install() -> None:
    after_import("megatron.core.optimizer.distrib_optimizer", loaded_without_autograd)
