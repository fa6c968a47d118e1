"""Megatron's core attention through ``torch.nn.functional.scaled_dot_product_attention`` (and a
blockwise kernel for attention dropout where SDPA's flash kernel takes none): the same attention as
the fused softmax between two batched GEMMs, without writing the score matrix."""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys

import torch

from . import context_parallel
from .era import FULLY_MASKED_ROWS_ARE_ZERO
from .say import say_once
from .softmax import _scale_value

# Megatron's local core attention (DotProductAttention, the legacy CoreAttention) is two batched
# GEMMs around the masked softmax: the full [b, np, sq, sk] score matrix is written, read, written
# again as probabilities and read once more, in fp32 where the kernel semantics ask for it. Where
# upstream asks for the fused path (--masked-softmax-fusion, its default) the port computes the
# same attention with one torch.nn.functional.scaled_dot_product_attention call instead: flash
# attention on ROCm (AOTriton, MI200/MI300) and on the CPU, memory-efficient attention elsewhere,
# the math path last. Same softmax scale (apply_query_key_layer_scaling's coefficient cancels, as
# in the kernel), causal and padding masks, fully masked rows as the era has them, GQA without
# repeating K/V, MLA's value head dim, attention dropout under Megatron's RNG tracker. What SDPA
# cannot express (additive biases, sliding windows, softmax offsets, packed sequences) runs the
# kernel-exact softmax path above, said once. MEGATRON_ROCM_PORT_SDPA=0 or --attention-backend
# local|unfused keep that path everywhere.
SDPA_ENV = "MEGATRON_ROCM_PORT_SDPA"
# Set once TransformerEngine's layer specs were asked for and the local ones built in their place:
# the attention asked for is then TE's fused one, whatever --masked-softmax-fusion says.
_TE_ATTENTION_SERVED = False
_KERNEL_EXACT_BACKENDS = ("local", "unfused")


def sdpa_enabled() -> bool:
    """False when the user asked for the kernel-exact softmax path (MEGATRON_ROCM_PORT_SDPA=0)."""
    return os.environ.get(SDPA_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def sdpa_backend(query, key, value, mask, dropout_p: float, causal: bool, scale: float, gqa: bool) -> str:
    """Which of SDPA's kernels these inputs take: flash, efficient, cudnn or math ("unknown" where
    this torch cannot say). Asked once per layout; the training log names it."""
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    try:
        kwargs = {"enable_gqa": True} if gqa else {}
        choice = torch._fused_sdp_choice(query, key, value, mask, dropout_p, causal, scale=scale, **kwargs)
        return names.get(int(choice), "unknown")
    except Exception:  # a private helper: its absence must never stop training
        return "unknown"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. Upstream's linear layers of 2021-2022
    ``view`` the gradient of their output in backward; after the unfused path's GEMMs it was always
    contiguous, after SDPA's backward it need not be (T5's cross-attention on a 2022 tree: "view
    size is not compatible")."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


# One query block's fp32 scores [b, n, rows, sk] of :func:`blockwise_attention` hold about this
# many elements (8 MiB). E2's GPT attention ([2, 4, 2048, 64], causal, dropout 0.1, fwd+bwd, this
# project's 2-core CPU): blocks of 64 rows 433-459 ms, 128: 433-495, 256: 404-477, 512: 467-578;
# upstream's unfused path 764-829 ms, SDPA's math kernel 740-823 ms. Blocks of 2^20 (idle, fp16,
# medians of five): [2, 8, 512] 62 ms against 81, [2, 8, 1024] 192 against 202, 2048 within 2 %;
# but E2's training step then read 1313-1343 ms against 1169-1188 (one noisy pass each), so 2^21.
_BLOCK_ELEMENTS = 1 << 21


def _block_rows(heads_total: int, sq: int, sk: int) -> int:
    """Query rows per block: :data:`_BLOCK_ELEMENTS` over the scores of one row, a multiple of 16."""
    rows = _BLOCK_ELEMENTS // max(1, heads_total * sk) // 16 * 16
    return max(16, min(sq, rows))


def _block_scores(q, k, allowed, causal: bool, scale: float, i0: int, i1: int):
    """The scores (fp32 at least) of query rows ``i0:i1`` against the keys they may see (all of them, or up to
    the causal diagonal), masked positions at -inf: (scores, number of keys)."""
    kv = min(i1, k.shape[-2]) if causal else k.shape[-2]
    scores = torch.matmul(q[..., i0:i1, :], k[..., :kv, :].transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(scale)
    if causal and kv > i0:  # the diagonal block: key j > query i is the future
        rows = torch.arange(i0, i1, device=q.device).unsqueeze(-1)
        future = torch.arange(i0, kv, device=q.device) > rows
        scores[..., i0:kv].masked_fill_(future, -math.inf)
    if allowed is not None:
        rows = allowed if allowed.shape[-2] == 1 else allowed[..., i0:i1, :]
        scores.masked_fill_(~rows[..., :kv], -math.inf)
    return scores, kv


def _kept(shape, dropout_p: float, seed: int, i0: int, device):
    """Block ``i0``'s dropout mask (True = kept), drawn again in backward from the same seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + i0)
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


class _BlockwiseAttention(torch.autograd.Function):
    """softmax(scale · q kᵀ, masked) with dropout, times v, one block of query rows at a time.

    Forward keeps each row's log-sum-exp; backward recomputes a block's probabilities from it and
    its dropout mask from the block's seed, so no [sq, sk] tensor outlives a block, and causal
    attention never computes the future (about half the GEMMs and softmax work)."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, dropout_p, causal, scale, seed):
        b, n, sq, _ = q.shape
        rows = _block_rows(b * n, sq, k.shape[-2])
        out = q.new_empty(b, n, sq, v.shape[-1])
        lse = torch.empty(b, n, sq, 1, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for i0 in range(0, sq, rows):
            i1 = min(i0 + rows, sq)
            scores, kv = _block_scores(q, k, allowed, causal, scale, i0, i1)
            lse[..., i0:i1, :] = torch.logsumexp(scores, dim=-1, keepdim=True)
            probs = scores.sub_(lse[..., i0:i1, :]).exp_()
            if dropout_p > 0:
                probs.masked_fill_(~_kept(probs.shape, dropout_p, seed, i0, q.device), 0.0).mul_(1 / (1 - dropout_p))
            out[..., i0:i1, :] = torch.matmul(probs.to(v.dtype), v[..., :kv, :])
        ctx.save_for_backward(q, k, v, allowed, lse)
        ctx.settings = (dropout_p, causal, scale, seed, rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, allowed, lse = ctx.saved_tensors
        dropout_p, causal, scale, seed, rows = ctx.settings
        grad = grad.contiguous()
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (k, v))
        for i0 in range(0, q.shape[-2], rows):
            i1 = min(i0 + rows, q.shape[-2])
            scores, kv = _block_scores(q, k, allowed, causal, scale, i0, i1)
            probs = scores.sub_(lse[..., i0:i1, :]).exp_()
            g = grad[..., i0:i1, :]
            d_dropped = torch.matmul(g, v[..., :kv, :].transpose(-1, -2)).to(probs.dtype)
            dropped = probs
            if dropout_p > 0:
                dropped_out = ~_kept(probs.shape, dropout_p, seed, i0, q.device)
                dropped = probs.masked_fill(dropped_out, 0.0).mul_(1 / (1 - dropout_p))
                d_dropped.masked_fill_(dropped_out, 0.0).mul_(1 / (1 - dropout_p))
            dv[..., :kv, :] += torch.matmul(dropped.to(v.dtype).transpose(-1, -2), g)
            # the kernels' backward: dx = scale * (y*g - y*sum(y*g))
            row_sums = (d_dropped * probs).sum(dim=-1, keepdim=True)
            d_scores = d_dropped.sub_(row_sums).mul_(probs).mul_(scale).to(q.dtype)
            dq[..., i0:i1, :] = torch.matmul(d_scores, k[..., :kv, :])
            dk[..., :kv, :] += torch.matmul(d_scores.transpose(-1, -2), q[..., i0:i1, :])
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def blockwise_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                        scale: float | None = None, enable_gqa: bool = False):
    """``torch.nn.functional.scaled_dot_product_attention`` (same arguments, boolean ``attn_mask``,
    True = attend) computed a block of query rows at a time, for attention dropout where SDPA's
    fused kernels take none (the CPU's flash kernel): SDPA's math kernel, which does, holds the
    whole fp32 score matrix for backward. Dropout draws one seed from the current generator (inside
    Megatron's RNG tracker, its model-parallel stream). On the CPU the GEMMs run in fp32 (half
    precision GEMMs are fast only on CPUs with AVX512-FP16/AMX; here fp32 took 0.92-1.0x the time
    of fp16 and bf16)."""
    heads, groups = query.shape[-3], key.shape[-3]
    if enable_gqa and groups != heads:
        key, value = (t.repeat_interleave(heads // groups, dim=-3) for t in (key, value))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    seed = int(torch.randint(1 << 62, (1,), device=query.device).item()) if dropout_p > 0 else 0
    half = query.dtype in (torch.float16, torch.bfloat16)
    dtype = torch.float32 if half and query.device.type == "cpu" else query.dtype
    q, k, v = (t.to(dtype).contiguous() for t in (query, key, value))  # each block's GEMMs read rows in place
    out = _BlockwiseAttention.apply(q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale, seed)
    return out.to(query.dtype)


def flash_takes_dropout(device) -> bool:
    """Whether SDPA's flash kernel on ``device`` takes attention dropout: GPUs' do (AOTriton on
    ROCm), the CPU's does not."""
    return torch.device(device).type != "cpu"


def blockwise_wanted(device, dropout_p: float, causal: bool) -> bool:
    """Whether attention dropout on ``device`` runs :func:`blockwise_attention`: causal attention
    where SDPA's flash kernel takes no dropout. With a padding mask there is no future to skip, and
    the blockwise kernel's recomputation lost to the softmax path (2 cores, [2, 8, 2048, 64] fp16,
    dropout 0.1, fwd+bwd: blockwise 1789 ms, the softmax path 1079, upstream's unfused path 1636;
    causal: blockwise 686, softmax path 980, unfused 1495)."""
    return dropout_p > 0 and causal and not flash_takes_dropout(device)


def sdpa_core_attention(query, key, value, *, scale: float, causal: bool, mask=None, dropout_p: float = 0.0,
                        fully_masked_rows_are_zero: bool = True):
    """Megatron's core attention in one SDPA call.

    ``query`` [sq, b, np, dk], ``key`` [sk, b, ng, dk], ``value`` [sk, b, ng, dv] (ng divides np:
    GQA); ``mask`` None or bool broadcastable to [b, np, sq, sk], True = masked (Megatron's
    convention); ``causal`` ignores ``mask``, as the causal kernel does. Returns the context
    [sq, b, np * dv]. A fully masked row gives zeros where ``fully_masked_rows_are_zero`` (the kernel since
    2022-07) and otherwise the mean of the values (the uniform row of the softmax of -10000.0s).
    """
    sq, b, heads, dk = query.shape
    groups, dv = key.shape[2], value.shape[3]
    if torch.is_grad_enabled():
        query, key, value = (_ContiguousGrad.apply(t) if t.requires_grad else t for t in (query, key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
    if dv < dk:  # zero columns of V add zero columns to the output: flash needs one head dim
        v = torch.nn.functional.pad(v, (0, dk - dv))
    elif dk < dv:  # zero columns of Q and K change no score
        q, k = (torch.nn.functional.pad(t, (0, dv - dk)) for t in (q, k))
    allowed, dead = None, None
    if mask is not None and not causal:
        if mask.dtype != torch.bool:
            mask = mask != 0
        dead = mask.all(dim=-1, keepdim=True)
        allowed = ~(mask & ~dead)  # a dead row attends everywhere (no NaN), then is overwritten
    kwargs = {"enable_gqa": True} if groups != heads else {}
    attend = blockwise_attention if blockwise_wanted(q.device, dropout_p, causal) else \
        torch.nn.functional.scaled_dot_product_attention
    out = attend(q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=causal, scale=scale, **kwargs)
    if dead is not None:
        if fully_masked_rows_are_zero:
            out = out.masked_fill(dead, 0.0)
        else:
            mean = v.mean(dim=-2, keepdim=True)
            if groups != heads:
                mean = mean.repeat_interleave(heads // groups, dim=1)
            out = torch.where(dead, mean.to(out.dtype), out)
    if out.shape[-1] != dv:
        out = out[..., :dv]
    # contiguous, as upstream's context layer: the flash kernels' output is [b, s, n, d] in memory,
    # and the era's linear layers view their saved input in 2-D in backward (2022-05's seqpar tree)
    return out.permute(2, 0, 1, 3).contiguous().view(sq, b, heads * dv)


def _kernel_exact_reason(core, config, extras: dict) -> str | None:
    """Why this core attention call keeps the softmax path, or None when SDPA computes it."""
    softmax = getattr(core, "scale_mask_softmax", None)
    if not sdpa_enabled():
        return f"{SDPA_ENV}=0"
    backend = getattr(getattr(config, "attention_backend", None), "name", None)
    if backend in _KERNEL_EXACT_BACKENDS:
        return f"--attention-backend {backend}"
    if softmax is None:
        return "a core attention without a softmax module"
    if not getattr(softmax, "scaled_masked_softmax_fusion", False) and not _TE_ATTENTION_SERVED:
        # where the flags asked for TransformerEngine's layers, its fused attention is what they
        # asked for (upstream's Mixtral script turns the softmax fusion off beside them)
        return "--no-masked-softmax-fusion (upstream's unfused attention, as asked)"
    if getattr(softmax, "window_size", None) is not None:
        return "a sliding attention window"
    if getattr(core, "softmax_offset", None) is not None:
        return "a softmax offset (--softmax-type off-by-one|learnable)"
    for name in ("attention_bias", "packed_seq_params", "alibi"):
        if extras.get(name) is not None:
            return name.replace("_", " ")
    return None


def _core_attention_scale(core) -> float:
    """The scale on Q·K: the GEMM's alpha times the softmax's own scale (the layer-scaling
    coefficient, which cancels)."""
    alpha = getattr(core, "softmax_scale", None)
    if alpha is None:
        alpha = 1.0 / core.norm_factor
    return float(alpha) * _scale_value(getattr(core.scale_mask_softmax, "scale", None))


def _rng_tracker(core):
    """Megatron's model-parallel RNG tracker, from the core attention's own module (the
    ``tensor_parallel`` package, or ``mpu`` in 2020-2022 trees)."""
    scope = sys.modules[type(core).__module__].__dict__
    for name in ("tensor_parallel", "mpu"):
        owner = scope.get(name)
        if owner is not None and hasattr(owner, "get_cuda_rng_tracker"):
            return owner.get_cuda_rng_tracker()
    return None


def _attention_through_sdpa(core, config, query, key, value, attention_mask, attn_mask_type):
    """Run one core attention call through :func:`sdpa_core_attention`: (its output, None), or
    (None, why the softmax path runs instead) where this call's masks, shapes or device ask for it."""
    softmax = core.scale_mask_softmax
    causal = getattr(attn_mask_type, "name", str(attn_mask_type)) == "causal"
    sixteen_bit = bool(getattr(softmax, "input_in_float16", False))
    if causal and query.shape[0] != key.shape[0]:
        return None, "causal attention with sq != sk"
    if causal and attention_mask is not None and not sixteen_bit:
        causal = False  # upstream's torch path (fp32) applies the given mask, not the kernel's triangle
    if not causal and attention_mask is not None and attention_mask.dtype != torch.bool:
        return None, "a float attention mask"
    dropout = core.attention_dropout.p if core.training else 0.0
    if dropout > 0 and not causal and not flash_takes_dropout(query.device):
        return None, (f"attention dropout with a padding mask on {query.device.type} (SDPA's flash kernel there "
                      "takes no dropout, and with no causal future to skip the blockwise kernel is slower)")
    scale = _core_attention_scale(core)
    kwargs = dict(scale=scale, causal=causal, mask=None if causal else attention_mask, dropout_p=dropout,
                  fully_masked_rows_are_zero=FULLY_MASKED_ROWS_ARE_ZERO and sixteen_bit)
    key_name = (query.device.type, query.dtype, key.shape[2] != query.shape[2], causal, dropout > 0)
    if key_name not in _SDPA_SAID:
        _SDPA_SAID.add(key_name)
        q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
        # asked with the call's own head dims (a V narrower or wider than Q/K is padded to theirs) and mask
        v = value.permute(1, 2, 0, 3) if value.shape[-1] == key.shape[-1] else k
        what = f"{str(query.dtype).replace('torch.', '')}, {'causal' if causal else 'padding'} mask"
        if blockwise_wanted(query.device, dropout, causal):
            say_once(f"core attention: the port's blockwise attention on {query.device.type} ({what}, attention "
                     f"dropout {dropout:g}, fp32 query blocks, the causal future skipped) in place of the fused "
                     "softmax and two batched GEMMs: SDPA's flash kernel there takes no dropout")
        else:
            chosen = sdpa_backend(q, k, v, None if causal else attention_mask, dropout, causal, scale,
                                  key.shape[2] != query.shape[2])
            say_once(f"core attention: torch scaled_dot_product_attention ({chosen} backend on "
                     f"{query.device.type}, {what}) in place of the fused softmax and two batched GEMMs")
    return _under_attention_rng(core, config, dropout, lambda: sdpa_core_attention(query, key, value, **kwargs)), None


def _under_attention_rng(core, config, dropout: float, attend):
    """``attend()`` under Megatron's model-parallel RNG tracker where it draws dropout masks, as
    upstream's core attention does (under sequence parallelism it draws them from the default
    generator)."""
    tracker = _rng_tracker(core) if dropout > 0 and not getattr(config, "sequence_parallel", False) else None
    if tracker is None:
        return attend()
    with tracker.fork():
        return attend()


_SDPA_SAID = set()


def _route_core_attention_through_sdpa(cls, forward_names: tuple) -> None:
    """Wrap ``cls.forward`` (upstream's core attention) so that each call runs through SDPA where
    :func:`_kernel_exact_reason` allows it, and through upstream's own forward (with the port's
    softmax) otherwise. ``forward_names``: the names of query, key, value, mask in its signature."""
    if cls is None or getattr(cls, "_rocm_port_sdpa", False):
        return
    original = cls.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        config = getattr(self, "config", None)
        if getattr(self, "_rocm_port_cp", False):
            return _context_parallel_attention(self, config, bound, forward_names)
        reason = _kernel_exact_reason(self, config, bound)
        if reason is None:
            query, key, value, mask = (bound.get(n) for n in forward_names)
            mask_type = bound.get("attn_mask_type") or self.attn_mask_type
            out, reason = _attention_through_sdpa(self, config, query, key, value, mask, mask_type)
            if out is not None:
                return out
        say_once(f"core attention: the port's softmax path ({reason})")
        return original(self, *args, **kwargs)

    cls.forward = forward
    cls._rocm_port_sdpa = True


def _context_parallel_attention(core, config, bound: dict, forward_names: tuple):
    """One core attention call with context parallelism, without TransformerEngine: the port's
    all-gather attention (:mod:`.context_parallel`) over the CP group, dropout under Megatron's RNG
    tracker as in the SDPA path. What it cannot express is refused, never computed otherwise."""
    for name in ("attention_bias", "packed_seq_params"):
        if bound.get(name) is not None:
            raise ValueError(f"context parallelism without TransformerEngine takes no {name.replace('_', ' ')} "
                             "(the port's context-parallel attention)")
    if getattr(core.scale_mask_softmax, "window_size", None) is not None or getattr(core, "softmax_offset", None) \
            is not None:
        raise ValueError("context parallelism without TransformerEngine takes no sliding window or softmax offset")
    query, key, value, mask = (bound.get(n) for n in forward_names)
    causal = getattr(bound.get("attn_mask_type") or core.attn_mask_type, "name", "") == "causal"
    group = core._rocm_port_cp_group
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    dropout = core.attention_dropout.p if core.training else 0.0
    say_once(f"core attention: context parallelism over {torch.distributed.get_world_size(group)} ranks without "
             "TransformerEngine (the port's attention: K/V all-gathered, blocks merged by log-sum-exp)")
    kwargs = dict(group=group, scale=_core_attention_scale(core), causal=causal, dropout_p=dropout,
                  attn_mask=None if causal else mask)
    return _under_attention_rng(core, config, dropout,
                                lambda: context_parallel.context_parallel_attention(query, key, value, **kwargs))


def _take_context_parallelism(cls) -> None:
    """Upstream's local ``DotProductAttention`` asserts ``context_parallel_size == 1`` (only TE's
    attention did CP): with more, it is built as for one and remembers the CP group, and its
    forward runs :func:`_context_parallel_attention`. ``--cp-comm-type`` is answered in one line."""
    if cls is None or getattr(cls, "_rocm_port_cp_init", False):
        return
    original = cls.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        config = bound["config"]
        size = getattr(config, "context_parallel_size", 1)
        if size == 1:
            return original(self, *args, **kwargs)
        served, line = context_parallel.cp_comm_type_answer(bound.get("cp_comm_type") or
                                                            getattr(config, "cp_comm_type", None))
        if not served:
            raise ValueError(line)
        say_once(line)
        config.context_parallel_size = 1
        try:
            original(self, *args, **kwargs)
        finally:
            config.context_parallel_size = size
        self._rocm_port_cp = True
        self._rocm_port_cp_group = getattr(bound.get("pg_collection"), "cp", None)

    cls.__init__ = __init__
    cls._rocm_port_cp_init = True


def _sdpa_in_dot_product_attention(module) -> None:
    _take_context_parallelism(getattr(module, "DotProductAttention", None))
    _route_core_attention_through_sdpa(getattr(module, "DotProductAttention", None),
                                       tuple(list(inspect.signature(module.DotProductAttention.forward).parameters)[1:5]))


def flash_attn_varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **_):
    """flash-attn's ``flash_attn_varlen_func`` (``flash_attn_unpadded_func`` before 2.0) through SDPA:
    ``q`` [total_q, h, d], ``k``/``v`` [total_k, h_kv, d] packed by ``cu_seqlens``; causal is aligned
    to the bottom-right corner, as flash-attn 2.1 on. Segments of one length (how upstream's
    FlashSelfAttention packs a batch) run as one batched call; causal dropout on the CPU runs blockwise."""
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}

    def attend(qs, ks, vs):  # [b, s, h, d]
        sq, sk = qs.shape[1], ks.shape[1]
        mask = None
        if causal and sq != sk:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=qs.device).tril(sk - sq)
        attention = blockwise_attention if blockwise_wanted(qs.device, dropout_p, causal) else \
            torch.nn.functional.scaled_dot_product_attention
        out = attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), attn_mask=mask,
                        dropout_p=dropout_p, is_causal=causal and sq == sk, scale=softmax_scale, **gqa)
        return out.transpose(1, 2)

    if len(set(lengths_q)) == 1 and len(set(lengths_k)) == 1:
        b = len(lengths_q)
        out = attend(q.view(b, lengths_q[0], *q.shape[1:]), k.view(b, lengths_k[0], *k.shape[1:]),
                     v.view(b, lengths_k[0], *v.shape[1:]))
        return out.reshape(q.shape[0], *out.shape[2:])
    pieces = [attend(q[a:a + lq][None], k[c:c + lk][None], v[c:c + lk][None])[0]
              for a, lq, c, lk in zip(cu_seqlens_q[:-1].tolist(), lengths_q, cu_seqlens_k[:-1].tolist(), lengths_k)]
    return torch.cat(pieces)


def _sdpa_in_legacy_core_attention(module) -> None:
    cls = getattr(module, "CoreAttention", None)
    if cls is not None:
        _route_core_attention_through_sdpa(cls, tuple(list(inspect.signature(cls.forward).parameters)[1:5]))
    # --use-flash-attn needs the flash_attn package, which a ROCm box rarely has: its varlen
    # function is served through SDPA (flash attention there too), said once.
    if "flash_attn_unpadded_func" in vars(module) and module.flash_attn_unpadded_func is None:
        def flash_attn_unpadded_func(*args, **kwargs):
            say_once("--use-flash-attn without the flash_attn package: torch scaled_dot_product_attention computes "
                     "FlashSelfAttention's attention")
            return flash_attn_varlen_sdpa(*args, **kwargs)

        module.flash_attn_unpadded_func = flash_attn_unpadded_func
