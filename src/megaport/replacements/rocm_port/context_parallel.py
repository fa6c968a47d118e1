"""Context parallelism (CP) for Megatron's core attention in PyTorch.

Upstream serves CP only in TransformerEngine's attention; its local ``DotProductAttention``
asserts ``context_parallel_size == 1``. This module computes the same attention where TE is
absent (ROCm without TE). Self-contained (torch and the standard library only) because it is
injected into upstream trees.

Layout: Megatron's load-balanced causal split (``get_batch_on_this_cp_rank``): the sequence is
cut into 2·cp chunks and CP rank r holds chunks r and 2·cp−1−r, concatenated, so every rank has
the same causal work. Each rank all-gathers K and V over the CP group (TE's ``allgather``
communication), attends its own query rows block by block (one query chunk against one key
chunk) in fp32 or wider, and merges the blocks by their log-sum-exp. Backward gathers K and V
again (nothing cp-sized is kept between passes), recomputes each block's probabilities from the
merged log-sum-exp and reduce-scatters dK and dV back to their owners.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")

# Planted faults, for tests that prove the reference check catches them: None (correct),
# "merge_without_lse" (blocks summed with their own normalisation, not by log-sum-exp) or
# "causal_offset" (query chunks taken as contiguous, not load-balanced: wrong causal offsets).
_FAULTS = (None, "merge_without_lse", "causal_offset")


def cp_comm_type_answer(comm_type) -> tuple[bool, str]:
    """(served, the one line to log) for upstream's ``--cp-comm-type`` (a string, or one per layer).

    All four choices compute the same attention; here they all run as K/V all-gather, so the
    communication differs from what was asked, never the result."""
    types = list(comm_type) if isinstance(comm_type, (list, tuple)) else [comm_type]
    names = ["p2p" if t is None else str(t).replace("_", "").lower() for t in types]
    unknown = sorted({t for t in names if t not in CP_COMM_TYPES})
    asked = " ".join(dict.fromkeys(names))
    if unknown:
        return False, (f"--cp-comm-type {asked}: refused, {' '.join(unknown)} is not one of upstream's "
                       f"choices ({', '.join(CP_COMM_TYPES)})")
    return True, (f"--cp-comm-type {asked}: context parallelism without TransformerEngine runs the port's "
                  "PyTorch attention (K/V all-gathered over the CP group, blocks merged by log-sum-exp): "
                  "the same result, all-gather communication")


def local_chunk_indices(rank: int, cp: int) -> tuple[int, int]:
    """The two global sequence chunks (of 2·cp) that CP rank ``rank`` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def split_for_cp_rank(x: torch.Tensor, rank: int, cp: int, seq_dim: int = 0) -> torch.Tensor:
    """``x``'s part on CP rank ``rank`` (as upstream's ``get_batch_on_this_cp_rank``)."""
    chunks = x.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[c] for c in local_chunk_indices(rank, cp)], dim=seq_dim)


def _gathered_to_global(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp·s_local, ...] in rank order -> [2·cp, L, ...] chunks in sequence order."""
    x = x.view(cp, 2, x.shape[0] // (2 * cp), *x.shape[1:])
    return torch.cat([x[:, 0], x[:, 1].flip(0)])


def _global_to_gathered(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of :func:`_gathered_to_global`: [2·cp, L, ...] -> [cp·s_local, ...] in rank order."""
    x = torch.stack([x[:cp], x[cp:].flip(0)], dim=1)
    return x.reshape(-1, *x.shape[3:])


def _uses_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    if _uses_nccl(group):  # NCCL and RCCL
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of dim 0 (gloo has no reduce_scatter:
    all_reduce, then slice)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    if _uses_nccl(group):
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)
    return x.chunk(world)[dist.get_rank(group)].clone()


def _kept(shape, dropout_p: float, seed: int, block: int, device) -> torch.Tensor:
    """Block ``block``'s dropout mask (True = kept), drawn again in backward from the same seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + 1_000_003 * block) % (1 << 63))
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (fully masked rows) as 0, so exp(scores - lse) gives 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _Blocks:
    """One rank's view of the blocks: its query chunks' global indices and each block's scores."""

    def __init__(self, rank, cp, causal, mask, scale, fault):
        self.cp, self.causal, self.mask, self.scale = cp, causal, mask, scale
        # the fault takes rank r's rows as chunks 2r and 2r+1 (an unbalanced split)
        self.chunks = (2 * rank, 2 * rank + 1) if fault == "causal_offset" else local_chunk_indices(rank, cp)

    def keys(self, i: int):
        return range(self.chunks[i] + 1) if self.causal else range(2 * self.cp)

    def scores(self, q, k, i: int, j: int) -> torch.Tensor:
        """scale · q kᵀ for local query chunk ``i`` and global key chunk ``j``, -inf where masked."""
        s = torch.matmul(q[i], k[j].transpose(-1, -2)).mul_(self.scale)
        length = s.shape[-1]
        if self.causal and j == self.chunks[i]:
            future = torch.ones(length, length, dtype=torch.bool, device=s.device).triu_(1)
            s.masked_fill_(future, float("-inf"))
        if self.mask is not None:
            s.masked_fill_(self.mask[..., i * length:(i + 1) * length, j * length:(j + 1) * length],
                           float("-inf"))
        return s


class _ContextParallelAttention(torch.autograd.Function):
    """Attention of this rank's query rows over the whole (gathered) sequence; see the module doc."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal, mask, dropout_p, seed, fault):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        s_local, b, heads, _ = q.shape
        groups, dv, length = k.shape[2], v.shape[3], s_local // 2
        work = torch.promote_types(q.dtype, torch.float32)
        blocks = _Blocks(rank, cp, causal, mask, scale, fault)
        qb, kb, vb = _block_layout(q, k, v, group, work)
        out = torch.zeros(2, b, groups, heads // groups, length, dv, dtype=work, device=q.device)
        lse = torch.full((*out.shape[:-1], 1), float("-inf"), dtype=work, device=q.device)
        for i in range(2):
            for j in blocks.keys(i):
                s = blocks.scores(qb, kb, i, j)
                block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                p = s.sub_(_finite(block_lse)).exp_()
                if dropout_p > 0:
                    keep = _kept(p.shape, dropout_p, seed, blocks.chunks[i] * 2 * cp + j, q.device)
                    p.masked_fill_(~keep, 0.0).mul_(1.0 / (1.0 - dropout_p))
                o = torch.matmul(p, vb[j])
                if fault == "merge_without_lse":
                    out[i] += o
                    lse[i] = torch.logaddexp(lse[i], block_lse)
                    continue
                merged = torch.logaddexp(lse[i], block_lse)
                keep_old = torch.exp(lse[i] - _finite(merged))
                take_new = torch.exp(block_lse - _finite(merged))
                out[i] = out[i] * keep_old + o * take_new
                lse[i] = merged
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.settings = (group, scale, causal, dropout_p, seed, fault)
        return _to_megatron(out, q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, out, lse = ctx.saved_tensors
        group, scale, causal, dropout_p, seed, fault = ctx.settings
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        s_local, b, heads, _ = q.shape
        groups, dv, length = k.shape[2], v.shape[3], s_local // 2
        work = out.dtype
        blocks = _Blocks(rank, cp, causal, mask, scale, fault)
        qb, kb, vb = _block_layout(q, k, v, group, work)
        go = grad.reshape(2, length, b, groups, heads // groups, dv).permute(0, 2, 3, 4, 1, 5).to(work)
        row_dot = (go * out).sum(dim=-1, keepdim=True)  # D = rowsum(dO ∘ O), dropout included
        lse = _finite(lse)
        dq, dk, dvv = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
        for i in range(2):
            for j in blocks.keys(i):
                p = blocks.scores(qb, kb, i, j).sub_(lse[i]).exp_()
                d_dropped = torch.matmul(go[i], vb[j].transpose(-1, -2))
                dropped = p
                if dropout_p > 0:
                    keep = _kept(p.shape, dropout_p, seed, blocks.chunks[i] * 2 * cp + j, q.device)
                    dropped = p.masked_fill(~keep, 0.0).mul_(1.0 / (1.0 - dropout_p))
                    d_dropped.masked_fill_(~keep, 0.0).mul_(1.0 / (1.0 - dropout_p))
                dvv[j] += torch.matmul(dropped.transpose(-1, -2), go[i]).sum(dim=2, keepdim=True)
                d_scores = d_dropped.sub_(row_dot[i]).mul_(p).mul_(scale)
                dq[i] += torch.matmul(d_scores, kb[j])
                dk[j] += torch.matmul(d_scores.transpose(-1, -2), qb[i]).sum(dim=2, keepdim=True)
        dq = dq.permute(0, 4, 1, 2, 3, 5).reshape(q.shape).to(q.dtype)
        dk, dvv = (_reduce_scatter(_global_to_gathered(t.squeeze(3).permute(0, 3, 1, 2, 4), cp), group)
                   for t in (dk, dvv))
        return dq, dk.to(k.dtype), dvv.to(v.dtype), None, None, None, None, None, None, None


def _block_layout(q, k, v, group, work):
    """q -> [2, b, g, rep, L, d]; K, V gathered -> [2·cp, b, g, 1, L, d] in sequence order; all in
    ``work`` precision (GQA's query heads grouped under their shared K/V head)."""
    cp = dist.get_world_size(group)
    s_local, b, heads, dk = q.shape
    groups, length = k.shape[2], s_local // 2
    qb = q.reshape(2, length, b, groups, heads // groups, dk).permute(0, 2, 3, 4, 1, 5).to(work)
    kb, vb = (_gathered_to_global(_all_gather(t, group), cp).permute(0, 2, 3, 1, 4).unsqueeze(3).to(work)
              for t in (k, v))
    return qb, kb, vb


def _to_megatron(out, dtype):
    """[2, b, g, rep, L, dv] -> Megatron's context layer [s_local, b, heads·dv]."""
    _, b, groups, rep, length, dv = out.shape
    return out.permute(0, 4, 1, 2, 3, 5).reshape(2 * length, b, groups * rep * dv).to(dtype)


def context_parallel_attention(query, key, value, *, group, scale=None, causal: bool = True,
                               dropout_p: float = 0.0, attn_mask=None, _fault=None):
    """Core attention of this CP rank's rows, the sequence split over ``group``.

    ``query`` [s_local, b, heads, dk], ``key`` [s_local, b, groups, dk], ``value``
    [s_local, b, groups, dv] (groups divides heads: GQA; dv may differ from dk: MLA), each rank's
    chunks r and 2·cp−1−r of the sequence. ``causal``: the global causal mask. ``attn_mask``:
    None or bool broadcastable to [b, heads, s_local, s_global], True = masked, this rank's query
    rows against keys in sequence order (how ``get_batch_on_this_cp_rank`` splits Megatron's
    mask); fully masked rows give zeros. Dropout draws one seed from the current generator
    (Megatron's RNG tracker where the caller forks it). Returns [s_local, b, heads·dv]."""
    if _fault not in _FAULTS:
        raise ValueError(f"unknown planted fault {_fault!r}")
    s_local, b, heads, dk = query.shape
    groups = key.shape[2]
    if key.shape[0] != s_local or value.shape[0] != s_local:
        raise ValueError("context-parallel attention is self-attention: query, key and value share the sequence")
    if s_local % 2:
        raise ValueError(f"a CP rank holds two equal chunks: its sequence length {s_local} is odd")
    if heads % groups or value.shape[2] != groups or key.shape[-1] != dk:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                         "the key/value heads must divide the query heads, and key's head dim match query's")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention dropout {dropout_p} outside [0, 1)")
    cp = dist.get_world_size(group)
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask != 0
        if mask.dim() != 4 or mask.shape[-2:] != (s_local, cp * s_local) or mask.shape[1] not in (1, heads):
            raise ValueError(f"attn_mask {tuple(mask.shape)}: expected [b|1, heads|1, {s_local}, {cp * s_local}]")
        # query heads grouped as [g, rep], as the blocks are
        mask = mask.reshape(mask.shape[0], groups if mask.shape[1] == heads else 1, -1, *mask.shape[-2:])
    scale = 1.0 / math.sqrt(dk) if scale is None else float(scale)
    seed = int(torch.randint(1 << 62, (1,), device=query.device).item()) if dropout_p > 0 else 0
    return _ContextParallelAttention.apply(query, key, value, group, scale, bool(causal), mask,
                                           float(dropout_p), seed, _fault)
