"""apex's pieces Megatron calls (layer norm and RMS norm functions, ``amp_C``'s multi-tensor ops,
fused optimizers, the weight-gradient GEMM extension) in PyTorch: on ROCm apex is missing, or a
build that may JIT-compile kernels on first use."""

from __future__ import annotations

import types

import torch

from .say import say_once


def _shape_tuple(normalized_shape) -> tuple:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


def _like_input(p, x):
    return p if p is None or p.dtype == x.dtype else p.to(x.dtype)


class FusedLayerNormAffineFunction:
    """Drop-in for apex's ``FusedLayerNormAffineFunction``, computed by PyTorch."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        # ``memory_efficient`` is accepted (upstream inspects the signature) and ignored.
        return torch.nn.functional.layer_norm(
            input, _shape_tuple(normalized_shape), _like_input(weight, input),
            _like_input(bias, input), eps,
        )

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return FusedLayerNormAffineFunction.forward(
            None, input, weight, bias, normalized_shape, eps, memory_efficient
        )


class FusedRMSNormAffineFunction:
    """Drop-in for apex's ``FusedRMSNormAffineFunction``, computed by PyTorch."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        shape = _shape_tuple(normalized_shape)
        weight = _like_input(weight, input)
        rms_norm = getattr(torch.nn.functional, "rms_norm", None)
        if rms_norm is not None:
            return rms_norm(input, shape, weight, eps)
        dims = tuple(range(-len(shape), 0))
        x = input.float()
        y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        return y.to(input.dtype)

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        return FusedRMSNormAffineFunction.forward(
            None, input, weight, normalized_shape, eps, memory_efficient
        )


# Per device type: whether ``torch.addmm(..., out_dtype=, out=)`` (aten::addmm.dtype_out)
# runs there and gives the right numbers.  torch 2.13 registers it for GPU backends only.
_ADDMM_OUT_DTYPE_OK = {}


def _addmm_out_dtype_ok(device: torch.device) -> bool:
    """Checked once per device type on a small product against fp64; False where missing."""
    key = device.type
    if key not in _ADDMM_OUT_DTYPE_OK:
        ok = False
        try:
            a = torch.arange(-6, 6, device=device, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
            b = torch.arange(-4, 4, device=device, dtype=torch.float32).reshape(4, 2).to(torch.bfloat16)
            acc = torch.full((3, 2), 0.5, device=device, dtype=torch.float32)
            want = acc.double() + a.double() @ b.double()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = acc.dtype == torch.float32 and bool(torch.equal(acc.double(), want))
        except Exception:  # not registered for this backend, or an older torch
            ok = False
        _ADDMM_OUT_DTYPE_OK[key] = ok
    return _ADDMM_OUT_DTYPE_OK[key]


def _wgrad_gemm_accum(total_input, grad_output, main_grad):
    """``main_grad += grad_output^T @ total_input``, in place, with no fp32 copy of an operand.

    Where the device has aten's mixed-dtype GEMM the product accumulates straight into the
    fp32 ``main_grad`` (apex's kernel does the same).  Elsewhere the product is formed in the
    operands' dtype and added, as upstream does with the fusion turned off.
    """
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if x.dtype == main_grad.dtype:
        main_grad.addmm_(g.t(), x)
    elif _addmm_out_dtype_ok(main_grad.device):
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(torch.mm(g.t(), x))


# Stands in for the apex extension module of the same name.
fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_wgrad_gemm_accum,
    wgrad_gemm_accum_fp16=_wgrad_gemm_accum,
)


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6):
    """Drop-in for apex's ``fused_layer_norm_affine`` (the legacy models call it)."""
    return FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps)


def _norm_stats_shape(input, normalized_shape):
    """apex keeps mean/invvar flat, one value per normalised row."""
    rows = input.numel() // max(1, _numel(normalized_shape))
    return (rows,)


def _numel(shape) -> int:
    n = 1
    for d in _shape_tuple(shape):
        n *= d
    return n


def _forward_affine(input, normalized_shape, weight, bias, eps):
    """apex ``fused_mix_prec_layer_norm_cuda.forward_affine``: (output, mean, invvar)."""
    shape = _shape_tuple(normalized_shape)
    out, mean, rstd = torch.ops.aten.native_layer_norm(
        input, shape, _like_input(weight, input), _like_input(bias, input), eps
    )
    flat = _norm_stats_shape(input, shape)
    return out, mean.reshape(flat), rstd.reshape(flat)


def _backward_affine(grad_output, mean, invvar, input, normalized_shape, weight, bias, eps):
    """apex ``backward_affine``: (grad_input, grad_weight, grad_bias) in the parameters' dtypes."""
    shape = _shape_tuple(normalized_shape)
    stats = input.shape[: input.dim() - len(shape)] + (1,) * len(shape)
    grad_input, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad_output, input, shape, mean.reshape(stats), invvar.reshape(stats),
        _like_input(weight, input), _like_input(bias, input), [True, weight is not None, bias is not None],
    )
    if grad_weight is not None and weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None and bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_input, grad_weight, grad_bias


# Stands in for apex's extension, which old megatron/model/fused_layer_norm.py loads by name.
fused_mix_prec_layer_norm_cuda = types.SimpleNamespace(
    forward_affine=_forward_affine,
    backward_affine=_backward_affine,
)


def _raise_flag_if_not_finite(noop_flag, values):
    """``noop_flag = 1`` where ``values`` holds inf/nan, on the device: no host sync."""
    bad = torch.logical_not(torch.isfinite(values).all()).to(noop_flag.dtype)
    torch.maximum(noop_flag, bad, out=noop_flag)


def _multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """apex ``amp_C.multi_tensor_l2norm``: (total norm [1], per-tensor norms) in fp32.

    One ``_foreach_norm`` pass accumulating in fp32 whatever the gradients' dtype, and no
    host sync however many tensors there are.
    """
    tensors = tensor_lists[0]
    if not tensors:
        empty = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)
        return empty, empty
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    _raise_flag_if_not_finite(noop_flag, total)
    return total, (norms if per_tensor else torch.zeros(0, device=total.device))


def _multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """apex ``amp_C.multi_tensor_scale``: dst = src * scale; flag non-finite values.

    Foreach kernels, in fp32 when either side is fp32 (apex's math), and the overflow flag
    set on the device: no host sync per tensor or per step.
    """
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if not srcs:
        return
    wide = [s for s, d in zip(srcs, dsts) if d.dtype != s.dtype and s.element_size() > d.element_size()]
    if scale != 1.0 and wide:
        # fp32 sources into fp16/bf16 destinations: scale in fp32, round once.
        scaled = torch._foreach_mul(srcs, scale)
        torch._foreach_copy_(dsts, scaled)
        _raise_flag_if_not_finite(noop_flag, torch.stack(torch._foreach_norm(scaled, float("inf"))))
        return
    if any(s is not d for s, d in zip(srcs, dsts)):
        torch._foreach_copy_(dsts, srcs)
    if scale != 1.0:
        torch._foreach_mul_(dsts, scale)
    _raise_flag_if_not_finite(
        noop_flag, torch.stack(torch._foreach_norm(dsts, float("inf"), dtype=torch.float32)))


# Stands in for apex's ``amp_C`` extension (the functions Megatron calls).
amp_C = types.SimpleNamespace(
    multi_tensor_l2norm=_multi_tensor_l2norm,
    multi_tensor_scale=_multi_tensor_scale,
)


def multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    """apex's ``multi_tensor_applier``: call ``op`` once over all tensors (no chunking needed)."""
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def _fused_supported(params) -> bool:
    """Whether torch's fused (single-kernel) optimizer step supports these parameters."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except Exception:  # older torch
        return False
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(
        isinstance(p, torch.Tensor) and p.is_floating_point() and p.device.type in devices for p in tensors)


def _apex_optimizer(base):
    """A torch optimizer that accepts apex's extra constructor arguments, as apex's fused one did.

    Its step is torch's fused kernel (``fused=True``) where the parameters' device has one,
    one kernel per parameter group rather than a Python loop, as apex's was.
    """

    class ApexCompatible(base):
        _APEX_ONLY = ("bias_correction", "adam_w_mode", "set_grad_none", "capturable", "master_weights",
                      "materialize_master_grads", "wd_after_momentum")

        def __init__(self, params, *args, **kwargs):
            adam_w_mode = kwargs.get("adam_w_mode", True)
            if issubclass(base, torch.optim.AdamW) and not adam_w_mode:
                raise ValueError("adam_w_mode=False (L2 Adam) is not supported by the ROCm port; use AdamW")
            for key in self._APEX_ONLY:
                kwargs.pop(key, None)
            if len(args) < 4:  # apex's default is no weight decay; torch's AdamW has 0.01
                kwargs.setdefault("weight_decay", 0.0)
            params = list(params)
            if "fused" not in kwargs and "foreach" not in kwargs and _fused_supported(params):
                kwargs["fused"] = True
            super().__init__(params, *args, **kwargs)

    ApexCompatible.__name__ = ApexCompatible.__qualname__ = f"Fused{base.__name__.replace('W', '')}"
    return ApexCompatible


_STEP_FROM_GROUP = ("the distributed optimizer loaded FusedAdam's state without its step (apex keeps it in the param "
                    "groups): the port's FusedAdam (torch's AdamW) takes each group's saved step")


def _steps_in_param_groups(base):
    """``base`` (torch's AdamW) keeping its step where apex's FusedAdam keeps it, in each param
    group, besides torch's per-parameter state.

    Upstream's distributed optimizer of 2023-05-24 … 2024-07-30 saves apex's param groups and, on
    a resume, rebuilds each parameter's state as ``exp_avg``/``exp_avg_sq`` alone (apex keeps no
    step there): torch's AdamW fails ``KeyError: 'step'`` (``float(None)`` from 2024-07-10, whose
    restored common step is None where apex wrote it). A parameter without its step takes its group's."""

    class StepInGroups(base):
        def __setstate__(self, state):
            for group in state["param_groups"]:  # a loaded state rebuilt without its step: the group's
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    if state["state"].get(p) and state["state"][p].get("step") is None:
                        say_once(_STEP_FROM_GROUP)
                        state["state"][p]["step"] = torch.tensor(float(group.get("step", 0)), dtype=torch.float32,
                                                                 device=p.device if on_device else None)
            super().__setstate__(state)

        @torch.no_grad()
        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:  # counted on the host, as apex does: no device sync
                if any(p.grad is not None for p in group["params"]):
                    group["step"] = group.get("step", 0) + 1
            return loss

    StepInGroups.__name__ = StepInGroups.__qualname__ = base.__name__
    return StepInGroups


# apex.optimizers.FusedAdam defaults to decoupled weight decay (adam_w_mode=True): torch's AdamW.
FusedAdam = _apex_optimizer(_steps_in_param_groups(torch.optim.AdamW))
FusedSGD = _apex_optimizer(torch.optim.SGD)
