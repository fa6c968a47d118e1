"""``apex``: apex and its CUDA extensions as a ROCm apex build gives them, computed in plain PyTorch.

Until 2023 Megatron imports apex, ``amp_C`` and the fused layer-norm extension unconditionally,
with its fusions on or off: its layer norm *is* apex's. Written here from apex's documented
interfaces and math (fp32 arithmetic, results in the input's or parameters' dtype), independently
of the port's stand-ins: a fault in the port's code must show as a parity failure, not sit on
both sides of the comparison. Plain loops and autograd, no speed tricks: this is the yardstick.

Served modules: ``apex`` (``optimizers``, ``multi_tensor_apply``, ``normalization``,
``contrib.layer_norm``), ``amp_C``, ``fused_mix_prec_layer_norm_cuda``/``fused_layer_norm_cuda``
and ``fused_weight_gradient_mlp_cuda``/``fused_dense_cuda`` (its 2022 name).
"""

from __future__ import annotations

import types

import torch

from megaport.train.shims._pattern import Match
from megaport.train.shims._serve import names_from, serve

NAME = "apex"
DESCRIPTION = ("apex, amp_C and the layer-norm/wgrad extensions in plain PyTorch, written apart from the port "
               "(what a ROCm apex build computes); the fusions under test stay upstream's unfused paths")
ERAS = "E1-E6 and the forks (trees that import apex unguarded)"
REPRODUCES = "apex (optimizers.FusedAdam/FusedSGD, amp_C, fused layer norm, fused wgrad GEMM)"
_APEX_MODULE = r"apex(\..*)?|amp_C|fused_\w*_cuda|\w*layer_norm_cuda"
PATTERN = (Match(("ModuleNotFoundError", "ImportError"), module=_APEX_MODULE),
           Match(("ValueError", "ImportError", "RuntimeError"), message=r"Apex must (currently )?be installed"),
           # core 0.9's distributed optimizer, which takes apex's FusedAdam where TE has none
           Match(("AssertionError",), message=r"Please install Apex or Transformer Engine to use DistributedOptimizer"))


# --- amp_C: multi-tensor ops -------------------------------------------------------------------

def _flag_non_finite(noop_flag: torch.Tensor, values: torch.Tensor) -> None:
    if not bool(torch.isfinite(values).all()):
        noop_flag.fill_(1)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """(the L2 norm of all tensors [1], each tensor's norm), in fp32."""
    norms = [t.detach().float().pow(2).sum().sqrt() for t in tensor_lists[0]]
    per = torch.stack(norms) if norms else torch.zeros(0, device=noop_flag.device)
    total = per.pow(2).sum().sqrt().reshape(1)
    _flag_non_finite(noop_flag, total)
    return total, (per if per_tensor else torch.zeros(0, device=total.device))


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``dst = src * scale`` in fp32, rounded once to dst's dtype; flags non-finite results."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        scaled = src.detach().float() * scale
        _flag_non_finite(noop_flag, scaled)
        dst.copy_(scaled)


def multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    """apex's applier: the op over all the lists at once (apex chunks them; the sums are the same)."""
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


amp_C = types.SimpleNamespace(multi_tensor_l2norm=multi_tensor_l2norm, multi_tensor_scale=multi_tensor_scale)


# --- layer norm -------------------------------------------------------------------------------

def _shape(normalized_shape) -> tuple:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _layer_norm_fp32(x, shape, weight, bias, eps):
    """Layer norm over the last ``len(shape)`` dims in fp32: (y, mean, invvar)."""
    dims = tuple(range(-len(shape), 0))
    x = x.float()
    mean = x.mean(dims, keepdim=True)
    invvar = torch.rsqrt((x - mean).pow(2).mean(dims, keepdim=True) + eps)
    y = (x - mean) * invvar
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y, mean, invvar


def forward_affine(input, normalized_shape, weight, bias, eps):
    """Megatron's/apex's mixed-precision extension: (output in the weight's dtype, mean, invvar),
    the statistics in fp32, one per normalised row."""
    y, mean, invvar = _layer_norm_fp32(input, _shape(normalized_shape), weight, bias, eps)
    return y.to(weight.dtype if weight is not None else input.dtype), mean.reshape(-1), invvar.reshape(-1)


def backward_affine(grad_output, mean, invvar, input, normalized_shape, weight, bias, eps):
    """(grad_input, grad_weight, grad_bias): the forward's fp32 math differentiated by autograd,
    each gradient in its tensor's dtype."""
    leaves = [t.detach().float().requires_grad_() if t is not None else None for t in (input, weight, bias)]
    with torch.enable_grad():
        y, _, _ = _layer_norm_fp32(leaves[0], _shape(normalized_shape), leaves[1], leaves[2], eps)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(y, wanted, grad_output.float()))
    return tuple(next(grads).to(t.dtype) if t is not None else None for t in (input, weight, bias))


layer_norm_extension = types.SimpleNamespace(forward_affine=forward_affine, backward_affine=backward_affine)


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """apex.normalization's function: the layer norm in fp32, output in the input's dtype."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        ctx.save_for_backward(input, weight, bias)
        ctx.shape, ctx.eps = _shape(normalized_shape), eps
        y, _, _ = _layer_norm_fp32(input, ctx.shape, weight, bias, eps)
        return y.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grads = backward_affine(grad_output, None, None, input, ctx.shape, weight, bias, ctx.eps)
        return (*grads, None, None, None)


def _rms_norm_fp32(x, shape, weight, eps):
    dims = tuple(range(-len(shape), 0))
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """apex.normalization's RMS norm function: fp32 math, output in the input's dtype."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        ctx.save_for_backward(input, weight)
        ctx.shape, ctx.eps = _shape(normalized_shape), eps
        return _rms_norm_fp32(input, ctx.shape, weight, eps).to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        x, w = input.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        with torch.enable_grad():
            gx, gw = torch.autograd.grad(_rms_norm_fp32(x, ctx.shape, w, ctx.eps), (x, w), grad_output.float())
        return gx.to(input.dtype), gw.to(weight.dtype), None, None, None


class FusedLayerNorm(torch.nn.LayerNorm):
    """apex's module: torch's LayerNorm signature and values."""


class FusedRMSNorm(torch.nn.Module):
    """apex's RMS norm module (Megatron-DeepSpeed 2023-12 on imports it as MixedFusedRMSNorm)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, **kwargs):
        super().__init__()
        self.normalized_shape, self.eps = _shape(normalized_shape), eps
        self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None

    def forward(self, x):
        return FusedRMSNormAffineFunction.apply(x, self.weight, self.normalized_shape, self.eps)


class FastLayerNormFN:
    """apex.contrib's persistent layer norm (2021-11 imports it unguarded): the same values."""

    @staticmethod
    def apply(x, weight, bias, eps):
        return FusedLayerNormAffineFunction.apply(x, weight, bias, weight.shape, eps)


# --- weight-gradient accumulation ---------------------------------------------------------------

def wgrad_gemm_accum(input, grad_output, main_grad):
    """``main_grad += grad_output^T @ input`` over all leading dims, accumulated in main_grad's dtype."""
    x = input.reshape(-1, input.shape[-1]).to(main_grad.dtype)
    g = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
    main_grad.add_(g.t() @ x)


wgrad_extension = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum, wgrad_gemm_accum_fp16=wgrad_gemm_accum)


# --- optimizers ---------------------------------------------------------------------------------

class FusedAdam(torch.optim.Adam):
    """apex's FusedAdam: Adam with decoupled weight decay (``adam_w_mode=True``, its default, is
    AdamW) or L2 (``adam_w_mode=False``); apex's other arguments accepted.

    Its state is laid out as apex's is, because checkpoints carry it: the step count in each param
    group (``group["step"]``), ``exp_avg`` and ``exp_avg_sq`` per parameter and no per-parameter
    ``step``. Upstream's distributed optimizer builds and reloads exactly that where apex or TE is
    present (an NVIDIA box), and a checkpoint written there holds it. The update is apex's
    multi_tensor_adam: ``m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps)``, plus ``wd * p`` (AdamW) in the
    update or ``wd * p`` in the gradient (L2), in fp32 plain loops.

    A subclass, not a factory of torch's optimizers: upstream's distributed optimizer asserts
    ``isinstance(optimizer, FusedAdam)`` (core 0.6 on: "Only Adam currently supported")."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, **apex_only):
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) has no torch equivalent")
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")  # apex's own refusal
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam_w_mode = adam_w_mode

    def __setstate__(self, state):
        """A loaded state as apex keeps it: torch's Adam would ask each parameter's for a ``step``."""
        torch.optim.Optimizer.__setstate__(self, state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), lr, eps, decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            first, second = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                grad, weight = param.grad.float(), param.float()
                if not self.adam_w_mode and decay:
                    grad = grad + decay * weight
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (state["exp_avg"] / first) / ((state["exp_avg_sq"] / second).sqrt() + eps)
                if self.adam_w_mode and decay:
                    update = update + decay * weight
                param.copy_(weight - lr * update)
        return loss


class FusedSGD(torch.optim.SGD):
    """apex's FusedSGD: torch's SGD; apex's other arguments accepted."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **apex_only):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)


# --- the modules --------------------------------------------------------------------------------

def _apex(module) -> None:
    import importlib

    for sub in ("optimizers", "multi_tensor_apply", "normalization"):  # what `import apex` gives
        setattr(module, sub, importlib.import_module(f"apex.{sub}"))


_NORMALIZATION = types.SimpleNamespace(
    FusedLayerNorm=FusedLayerNorm, MixedFusedLayerNorm=FusedLayerNorm, FusedRMSNorm=FusedRMSNorm,
    MixedFusedRMSNorm=FusedRMSNorm, FusedLayerNormAffineFunction=FusedLayerNormAffineFunction,
    FusedRMSNormAffineFunction=FusedRMSNormAffineFunction)
MODULES = {
    "apex": _apex,
    "apex.optimizers": names_from(types.SimpleNamespace(FusedAdam=FusedAdam, FusedSGD=FusedSGD)),
    "apex.multi_tensor_apply": names_from(types.SimpleNamespace(multi_tensor_applier=multi_tensor_applier)),
    "apex.normalization": names_from(_NORMALIZATION),
    "apex.normalization.fused_layer_norm": names_from(_NORMALIZATION),
    "apex.contrib": lambda module: None,
    "apex.contrib.layer_norm": lambda module: None,
    "apex.contrib.layer_norm.layer_norm": names_from(types.SimpleNamespace(FastLayerNormFN=FastLayerNormFN)),
    "amp_C": names_from(amp_C),
    "fused_mix_prec_layer_norm_cuda": names_from(layer_norm_extension),
    "fused_layer_norm_cuda": names_from(layer_norm_extension),
    "fused_weight_gradient_mlp_cuda": names_from(wgrad_extension),
    "fused_dense_cuda": names_from(wgrad_extension),
}
PACKAGES = {"apex", "apex.optimizers", "apex.multi_tensor_apply", "apex.normalization", "apex.contrib",
            "apex.contrib.layer_norm"}


def install() -> None:
    serve(MODULES, PACKAGES)
