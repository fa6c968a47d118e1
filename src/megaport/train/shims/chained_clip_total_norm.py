"""``chained-clip-total-norm``: a chain of optimizers clips by the norm of all the model's gradients.

From d657a3ef5c (2024-01-17) the expert parameters have their own optimizer, chained with the dense
one, and until ddfcc589c0 (2024-05-30, "Fix dual-optimizer gradient clipping issue")
``ChainedOptimizer.step`` stepped each whole: each clipped by its own norm, the experts' counted on
one expert-parallel rank. Nothing fails, so the Mixtral family lists this up front where the
unported tree's chain has no ``prepare_grads`` yet. Here, before the chain steps, every optimizer's
main gradients are put in place, the norm of them all is reduced (the experts' over the
expert-parallel ranks too, unless the optimizer already reduces over the whole world), and each
optimizer's clipping is handed that norm for the one step.
The port fixes the same window in its own way (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

import math

from megaport.train.hooks import after_import
from megaport.train.tree_files import tree_text

NAME = "chained-clip-total-norm"
DESCRIPTION = ("main 2024-01-17 (d657a3ef5c) … 2024-05-30 (ddfcc589c0): the chained expert and dense optimizers "
               "each clipped by their own norm; every one clips by the norm of all the gradients, as upstream's "
               "ddfcc589c0 does")
ERAS = "main 2024-01-17 (d657a3ef5c) … 2024-05-30 (ddfcc589c0), with expert parallelism"
REPRODUCES = "upstream's ddfcc589c0 (ChainedOptimizer: one grad norm, every optimizer clipped by it)"
#: listed up front by the Mixtral family, not asked for by a failure
PATTERN = ()
_FILES = ("megatron/core/optimizer/optimizer.py", "megatron/optimizer/optimizer.py")


def applies(tree: str) -> bool:
    """Whether the unported ``tree`` chains optimizers that each clip by their own norm."""
    for path in _FILES:
        text = tree_text(tree, path) or ""
        if "class ChainedOptimizer" in text:
            return "def prepare_grads" not in text
    return False


def _ready(optimizer):
    """Main gradients in place as the optimizer's own step puts them; the factor that unscales them."""
    if hasattr(optimizer, "_copy_model_grads_to_main_grads"):
        optimizer._copy_model_grads_to_main_grads()
    else:
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad
    scaler = getattr(optimizer, "grad_scaler", None)
    return 1.0 if scaler is None else scaler.inv_scale.item()


def _holds_experts(optimizer) -> bool:
    for group in optimizer.optimizer.param_groups:
        if group.get("is_expert_parallel") or any(getattr(p, "allreduce", True) is False for p in group["params"]):
            return True
    return False


def _square(optimizer):
    import torch
    from megatron.core import parallel_state

    scale = _ready(optimizer)
    where = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    square = torch.tensor([0.0], device=where)
    for grad in optimizer.get_main_grads_for_grad_norm():
        square += (grad.float() * scale).pow(2).sum().to(square.device)
    group = optimizer.get_model_parallel_group()
    if group is not None and _holds_experts(optimizer):
        # the ranks holding a piece of the experts: tensor x expert x pipeline
        experts = getattr(parallel_state, "get_tensor_and_expert_parallel_group", None)
        if experts is None:
            torch.distributed.all_reduce(square, group=group)
            torch.distributed.all_reduce(square, group=parallel_state.get_expert_model_parallel_group())
        else:
            torch.distributed.all_reduce(square, group=experts())
            torch.distributed.all_reduce(square, group=parallel_state.get_pipeline_model_parallel_group())
    else:
        torch.distributed.all_reduce(square, group=group)
    return square.item()


def one_norm_for_the_chain(module) -> None:
    chain = getattr(module, "ChainedOptimizer", None)
    if chain is None or hasattr(chain, "prepare_grads"):
        return
    original = chain.step

    def step(self, *args, **kwargs):
        if len(self.chained_optimizers) < 2:
            return original(self, *args, **kwargs)
        norm = math.sqrt(sum(_square(o) for o in self.chained_optimizers))
        if not math.isfinite(norm):
            return original(self, *args, **kwargs)
        for optimizer in self.chained_optimizers:
            def clip(max_norm, *rest, _optimizer=optimizer, **kw):
                factor = max_norm / (norm + 1.0e-6)
                if factor < 1.0:
                    for param in _optimizer.get_parameters():
                        if param.grad is not None:
                            param.grad.data.mul_(factor)
                return norm
            optimizer.clip_grad_norm = clip
        try:
            ok, reported, zeros = original(self, *args, **kwargs)
        finally:
            for optimizer in self.chained_optimizers:
                optimizer.__dict__.pop("clip_grad_norm", None)
        return ok, (norm if reported else reported), zeros

    chain.step = step


def install() -> None:
    for name in ("megatron.core.optimizer.optimizer", "megatron.optimizer.optimizer"):
        after_import(name, one_norm_for_the_chain)
