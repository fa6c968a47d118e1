"""The fused softmax kernels (``scaled_masked_softmax_cuda`` and its siblings) in PyTorch, with the
kernels' semantics: inputs in fp16/bf16, math in fp32, results in the input dtype. Also the
one-kernel-per-pass compiling that the port's norm shares."""

from __future__ import annotations

import functools
import math
import os

import torch

from .era import FULLY_MASKED_ROWS_ARE_ZERO
from .say import say_once

# The value the masked-softmax kernel writes for a masked element (not scaled).
MASKED_VALUE = -10000.0

# How the softmax replacements keep memory traffic and temporaries down (measured by
# ``megaport bench`` and by the live-bytes tally in tests/test_replacements_gpu_paths.py):
#
# * When the kernels' fp32 math can run in the input dtype itself, everything happens in one
#   output-sized tensor: the input is scaled and masked into it and aten's softmax kernels
#   (which accumulate fp16/bf16 in fp32, as the CUDA kernels do) overwrite it in place.  That
#   holds for fp32/fp64 inputs and for scales that are powers of two no larger than 1 (1.0,
#   the common case, included): multiplying by them rounds nothing, provided the dtype holds
#   the mask value too (bf16 does not hold -10000.0).  The backward is then one
#   ``_softmax_backward_data`` call writing the input gradient.  Extra memory for forward and
#   backward together: the output and the gradient, 2x the input.
# * Otherwise (other scales, or a bf16 padding mask) the work is done in fp32, as in the
#   kernels, in an fp32 workspace that covers a bounded block of rows at a time and is
#   reused: 1/16 of the tensor on GPUs (2.25x the input at peak, fwd+bwd), about 16 MiB on
#   CPUs, where blocks
#   are kept large because each op is a parallel region and many small regions slow down
#   badly when other processes compete for the cores.
_CPU_BLOCK_ELEMENTS = 1 << 22
_GPU_BLOCKS = 16

_INPLACE_KERNELS_OK = {}


def _inplace_kernels_ok(device: torch.device) -> bool:
    """Whether aten's softmax forward/backward kernels may write over their input.

    They process one row at a time and read each element before writing it, so they
    can; this is checked once per device type, and the allocating ops are used if not.
    """
    key = device.type
    if key not in _INPLACE_KERNELS_OK:
        ok = False
        try:
            t = torch.linspace(-3.0, 3.0, 4 * 37, device=device).reshape(4, 37)
            y = torch.softmax(t, -1)
            a = t.clone()
            torch._softmax(a, -1, False, out=a)
            g = torch.cos(3.0 * t)
            ref = torch._softmax_backward_data(g, y, -1, torch.float32)
            b = g.clone()
            torch.ops.aten._softmax_backward_data.out(b, y, -1, torch.float32, grad_input=b)
            ok = bool(torch.allclose(a, y) and torch.allclose(b, ref, atol=1e-6))
        except Exception:  # old torch signatures, or an overlap check: use the slow path
            ok = False
        _INPLACE_KERNELS_OK[key] = ok
    return _INPLACE_KERNELS_OK[key]


def _softmax_(work: torch.Tensor, inplace: bool) -> None:
    """``work = softmax(work, -1)`` in place."""
    if inplace:
        torch._softmax(work, -1, False, out=work)
    else:
        work.copy_(torch.softmax(work, -1))


def _softmax_backward_(work: torch.Tensor, y: torch.Tensor, inplace: bool) -> None:
    """``work = y * (work - sum(work * y, -1))`` in place."""
    if inplace:
        torch.ops.aten._softmax_backward_data.out(work, y, -1, work.dtype, grad_input=work)
    else:
        work.sub_((work * y).sum(-1, keepdim=True)).mul_(y)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if not t.is_floating_point():
        raise TypeError(f"fused softmax replacement needs a floating-point input, got {t.dtype}")
    return torch.promote_types(t.dtype, torch.float32)


def _exact_in_input_dtype(dtype: torch.dtype, scale: float) -> bool:
    """Whether ``x * scale`` and the softmax can stay in ``dtype`` without changing a result.

    True for fp32/fp64 (the compute dtype itself) and for scales 2**-k (k >= 0), which
    multiply exactly; aten's kernels already accumulate fp16/bf16 in fp32.
    """
    if torch.promote_types(dtype, torch.float32) == dtype:
        return True
    mantissa, _ = math.frexp(scale)
    return 0.0 < scale <= 1.0 and mantissa == 0.5


@functools.lru_cache(maxsize=None)
def _holds_exactly(dtype: torch.dtype, value: float) -> bool:
    """Whether ``dtype`` represents ``value``: fp16 holds -10000.0, bf16 rounds it to -9984.0,
    which would tie with unmasked logits the kernel keeps apart (-inf is held by all)."""
    return float(torch.tensor(value, dtype=dtype)) == value


def _as4d(shape) -> tuple:
    """``shape`` as ``(A, B, sq, sk)``: leading dims folded into A, the one before sq is B."""
    dims = list(shape)
    if not dims:
        raise ValueError("fused softmax replacement needs at least one dimension")
    while len(dims) < 4:
        dims.insert(0, 1)
    a = 1
    for d in dims[:-3]:
        a *= d
    return (a, dims[-3], dims[-2], dims[-1])


def _blocks(shape4: tuple, block_elements):
    """Index tuples into a ``(A, B, sq, sk)`` tensor covering it in row blocks.

    A block is at least one row; the first block is the largest.
    """
    a_n, b_n, sq, sk = shape4
    if block_elements is None or a_n * b_n * sq * sk <= block_elements:
        yield (Ellipsis,)
        return
    per_b = sq * sk
    if per_b <= block_elements:
        nb = max(1, block_elements // max(per_b, 1))
        for a in range(a_n):
            for b0 in range(0, b_n, nb):
                yield (a, slice(b0, min(b0 + nb, b_n)))
    else:
        rows = max(1, block_elements // max(sk, 1))
        for a in range(a_n):
            for b in range(b_n):
                for r0 in range(0, sq, rows):
                    yield (a, b, slice(r0, min(r0 + rows, sq)))


def _block_elements(device: torch.device, numel: int) -> int:
    """Elements of the fp32 workspace block (see the note above ``_CPU_BLOCK_ELEMENTS``)."""
    return _CPU_BLOCK_ELEMENTS if device.type == "cpu" else _gpu_block_elements(numel)


def _gpu_block_elements(numel: int) -> int:
    return max(1, -(-numel // _GPU_BLOCKS))


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """``[sq, sk]`` bool, True above the diagonal: one plane, broadcast over the batch."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)


# Where Triton is available (PyTorch's ROCm and CUDA builds ship it), each softmax pass is one
# compiled kernel: the input is read once and the result written once, the math is fp32 in
# registers, and the causal mask is computed from indices, never stored.  The eager passes above
# read and write the data three or four times.  The port's norm (TE's, for Llama 3, MoE and MLA
# specs) is compiled the same way: fp32 casts, statistics and gamma in one kernel per pass.  Everywhere else, and from the moment compiling
# fails (one line says why), the eager paths run.  MEGATRON_ROCM_PORT_COMPILE=0 turns it off;
# =1 turns it on for any device (on a CPU inductor writes C++ instead of Triton).
_COMPILE_ENV = "MEGATRON_ROCM_PORT_COMPILE"
_COMPILED = {}


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        from torch.utils._triton import has_triton

        return bool(has_triton())
    except Exception:  # a torch without the helper, or a broken Triton install
        return False


def _compile_wanted(device: torch.device) -> bool:
    setting = os.environ.get(_COMPILE_ENV, "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return False
    if setting in ("1", "on", "true", "yes"):
        return True
    return device.type == "cuda" and _triton_available()


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on ``device``'s current stream."""
    try:
        return device.type == "cuda" and bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # a torch without the query
        return False


def _softmax_forward_body(x, mask, scale: float, fill: float, causal: bool, fully_masked_rows_are_zero: bool):
    """The kernels' forward in one expression (fp32 math, results in the input dtype)."""
    w = x.to(torch.promote_types(x.dtype, torch.float32)) * scale
    if causal:
        rows = torch.arange(w.shape[-2], device=w.device).unsqueeze(-1)
        w = w.masked_fill(torch.arange(w.shape[-1], device=w.device) > rows, fill)
    elif mask is not None:
        w = w.masked_fill(mask, fill)
    top = w.amax(-1, keepdim=True)
    # exp(w - logsumexp) rather than e / sum(e): only w, a cheap function of x, is needed twice,
    # so the compiler recomputes it instead of storing an fp32 copy of the whole input.
    y = torch.exp(w - (top + torch.log(torch.exp(w - top).sum(-1, keepdim=True))))
    if fully_masked_rows_are_zero:
        y = y.masked_fill(top == fill, 0.0)
    return y.to(x.dtype)


def _softmax_backward_body(g, y, scale: float):
    """The kernels' backward, ``scale * (y*g - y*sum(y*g))``, in one expression."""
    compute = torch.promote_types(y.dtype, torch.float32)
    gf, yf = g.to(compute), y.to(compute)
    return (scale * yf * (gf - (gf * yf).sum(-1, keepdim=True))).to(y.dtype)


def _run_compiled(what: str, key, body, device, *args):
    """``body(*args)`` compiled, or None when compiling is not wanted here or has failed.

    ``what`` names the port's op in the log line (the fused softmax, the norm). Each kind of call
    (``key``: pass, dtype, mask kind) fails on its own: a failure turns that kind, not every call
    of the op, back to the eager path. (torch.compile's recompile limit counts per body, whatever
    the key.) Autograd goes through a compiled ``body`` too: its backward is compiled with it."""
    if not _compile_wanted(device):
        return None
    if _COMPILED.get(key, True) is None:
        return None
    if key not in _COMPILED and _capturing(device):
        return None  # compiling inside a CUDA-graph capture fails: this call runs eager
    try:
        if key not in _COMPILED:
            # dynamic: one compile serves every sequence length (no recompiles as shapes change)
            _COMPILED[key] = torch.compile(body, dynamic=True, fullgraph=True)
            say_once(f"{what}: each pass compiled into one kernel "
                     f"({'Triton' if device.type == 'cuda' else device.type}); {_COMPILE_ENV}=0 turns this off")
        out = _COMPILED[key](*args)
    except Exception as exc:  # compiling can fail in many ways; the eager path is always right
        _COMPILED[key] = None
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        say_once(f"{what}: compiling failed ({type(exc).__name__}: {reason}); "
                 "the eager PyTorch path runs instead")
        return None
    return out if out.is_contiguous() else out.contiguous()


def _scaled_softmax_forward(x, scale, mask, fill, fully_masked_rows_are_zero, causal=False):
    """softmax(masked_fill(x * scale, mask, fill)) with the kernels' fp32 math.

    ``mask`` is None or a bool tensor that broadcasts to ``x``'s ``(A, B, sq, sk)`` view;
    ``causal`` masks positions ``j > i`` instead (the mask is then built only if needed).
    ``fully_masked_rows_are_zero``: rows whose maximum after masking is exactly ``fill`` give zeros.
    """
    compute = _compute_dtype(x)
    if x.numel():
        kind = ("forward", x.dtype, causal, mask is None, fully_masked_rows_are_zero)
        y = _run_compiled("fused softmax", kind, _softmax_forward_body, x.device,
                          x.reshape(_as4d(x.shape)), None if causal else mask, scale, fill, causal,
                          fully_masked_rows_are_zero)
        if y is not None:
            return y.view(x.shape)
    if causal:
        mask = _causal_mask(x.shape[-2], x.shape[-1], x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    shape4 = _as4d(x.shape)
    x4 = x.reshape(shape4)
    out4 = out.view(shape4)
    inplace = _inplace_kernels_ok(x.device)
    if _exact_in_input_dtype(x.dtype, scale) and _holds_exactly(x.dtype, fill):
        _fill_scaled_softmax_(out4, x4, scale, mask, fill, fully_masked_rows_are_zero, inplace)
        return out
    workspace = None
    for idx in _blocks(shape4, _block_elements(x.device, x.numel())):
        xb = x4[idx]
        if workspace is None:  # the first block is the largest
            workspace = torch.empty(xb.numel(), dtype=compute, device=x.device)
        work = workspace[: xb.numel()].view(xb.shape)
        mb = None if mask is None else mask.expand(shape4)[idx]
        _fill_scaled_softmax_(work, xb, scale, mb, fill, fully_masked_rows_are_zero, inplace)
        out4[idx].copy_(work)
    return out


def _fill_scaled_softmax_(work, x, scale, mask, fill, fully_masked_rows_are_zero, inplace):
    """``work = softmax(masked_fill(x * scale, mask, fill))``, all of it inside ``work``."""
    if scale == 1.0:
        work.copy_(x)
    else:
        torch.mul(x, scale, out=work)
    if mask is not None:
        work.masked_fill_(mask, fill)
    dead = work.amax(-1, keepdim=True) == fill if fully_masked_rows_are_zero else None
    _softmax_(work, inplace)
    if dead is not None:
        work.masked_fill_(dead, 0.0)


def _scaled_softmax_backward(g, y, scale):
    """``scale * (y*g - y*sum(y*g, -1))`` with the kernels' fp32 math, in y's dtype."""
    if y.numel():
        gi = _run_compiled("fused softmax", ("backward", y.dtype), _softmax_backward_body, y.device, g, y, scale)
        if gi is not None:
            return gi
    gi = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if y.numel() == 0:
        return gi
    shape4 = _as4d(y.shape)
    g4 = g.reshape(shape4)
    y4 = y.reshape(shape4)
    gi4 = gi.view(shape4)
    inplace = _inplace_kernels_ok(y.device)
    if _exact_in_input_dtype(y.dtype, scale):
        if inplace:
            torch.ops.aten._softmax_backward_data.out(g4, y4, -1, y.dtype, grad_input=gi4)
        else:
            gi4.copy_(torch._softmax_backward_data(g4, y4, -1, y.dtype))
        if scale != 1.0:
            gi4.mul_(scale)
        return gi
    compute = _compute_dtype(y)
    wg = wy = None
    for idx in _blocks(shape4, _block_elements(y.device, y.numel())):
        gb = g4[idx]
        yb = y4[idx]
        if wg is None:  # the first block is the largest
            wg = torch.empty(yb.numel(), dtype=compute, device=y.device)
            wy = torch.empty(yb.numel(), dtype=compute, device=y.device)
        work = wg[: yb.numel()].view(yb.shape)
        ysrc = wy[: yb.numel()].view(yb.shape)
        # The result is linear in g, so scaling g first equals scaling the result.
        torch.mul(gb, scale, out=work)
        ysrc.copy_(yb)
        _softmax_backward_(work, ysrc, inplace)
        gi4[idx].copy_(work)
    return gi


def _scale_value(scale) -> float:
    return 1.0 if scale is None else float(scale)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Causal softmax: ``softmax(x * scale)`` with positions ``j > i`` exactly 0.

    Replaces ``scaled_upper_triang_masked_softmax_cuda``.  Input ``[..., sq, sk]``
    (the kernel takes ``[attn_batches, sq, sk]`` with sq == sk); the mask is aligned
    to the top-left corner when sq != sk.
    """

    @staticmethod
    def forward(ctx, inputs, scale):
        scale = _scale_value(scale)
        if inputs.dim() < 2:
            raise ValueError("causal softmax needs an input of at least 2 dimensions [..., sq, sk]")
        y = _scaled_softmax_forward(inputs, scale, None, float("-inf"), False, causal=True)
        ctx.scale = scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return _scaled_softmax_backward(grad_output, y, ctx.scale), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Masked softmax: masked elements (mask True) become -10000.0, the rest ``x * scale``.

    Replaces ``scaled_masked_softmax_cuda``.  Input ``[b, np, sq, sk]``, mask
    broadcastable to it (normally ``[b or 1, 1, sq, sk]``); ``mask=None`` is
    ``ScaledSoftmax``.  Fully masked rows follow ``FULLY_MASKED_ROWS_ARE_ZERO``.
    """

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        scale = _scale_value(scale)
        if mask is None:
            y = _scaled_softmax_forward(inputs, scale, None, MASKED_VALUE, False)
        else:
            if mask.dtype != torch.bool:
                mask = mask != 0
            # A view that broadcasts over (A, B, sq, sk); never a full-size copy of the mask.
            mask4 = mask.expand(inputs.shape).reshape(_as4d(inputs.shape)) if mask.dim() > 4 else mask
            y = _scaled_softmax_forward(
                inputs, scale, mask4, MASKED_VALUE, FULLY_MASKED_ROWS_ARE_ZERO
            )
        ctx.scale = scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return _scaled_softmax_backward(grad_output, y, ctx.scale), None, None


class ScaledSoftmax(torch.autograd.Function):
    """Plain ``softmax(x * scale)`` over the last dimension; replaces ``scaled_softmax_cuda``."""

    @staticmethod
    def forward(ctx, inputs, scale):
        scale = _scale_value(scale)
        y = _scaled_softmax_forward(inputs, scale, None, MASKED_VALUE, False)
        ctx.scale = scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return _scaled_softmax_backward(grad_output, y, ctx.scale), None


def warp_size() -> int:
    """The GPU's warp (wavefront) size: 64 on AMD gfx9 GPUs, 32 on NVIDIA GPUs."""
    try:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            size = getattr(props, "warp_size", None)
            if size:
                return int(size)
    except Exception:
        pass
    return 64 if getattr(torch.version, "hip", None) else 32


def get_batch_per_block(sq: int, sk: int, b: int, np: int, warp=None) -> int:
    """Replica of the extensions' ``get_batch_per_block`` (rows handled per CUDA block).

    Upstream uses it to decide whether the fused kernel applies; the replacements
    themselves take any shape.
    """
    pow2 = 1 << (int(sk) - 1).bit_length() if sk > 1 else 1
    warp = warp_size() if warp is None else int(warp)
    warp = min(pow2, warp)
    batches_per_warp = 2 if pow2 <= 128 else 1
    threads_per_block = 128
    warps_per_block = threads_per_block // warp
    return warps_per_block * batches_per_warp
