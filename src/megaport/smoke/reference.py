"""fp64 references for the smoke suite, written from the CUDA kernels' semantics.

Independent of the code under test (the tree's rocm_port package): masked elements become a literal
-10000.0 (not scaled), the rest ``x * scale``; causal future positions are exact zeros; fully
masked rows are zeros or uniform by era; backward is ``scale * (y*g - y*sum(y*g))`` from the
saved output. Only torch is imported, and only when a function is called.
"""

from __future__ import annotations

import math

MASKED_VALUE = -10000.0

# Largest error allowed relative to the reference's magnitude: upstream's kernel tests use 1e-3 for
# fp16; one bf16 rounding of a value near 1 is already 2e-3.
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3, "float64": 1e-12}


def tolerance(dtype) -> float:
    return TOLERANCE[str(dtype).replace("torch.", "")]


def causal_future(sq: int, sk: int, device=None, rows=None):
    """True above the diagonal; ``rows`` names the query rows when only some are given."""
    import torch

    rows = torch.arange(sq, device=device) if rows is None else rows.to(device)
    return torch.arange(sk, device=device)[None, :] > rows[:, None]


def softmax(x, scale: float, *, mask=None, causal: bool = False, fully_masked_rows_are_zero: bool = True, rows=None):
    """The kernels' forward in fp64, from the (already rounded) input values.

    ``rows``: for causal, the query row index of each row of ``x`` (when x holds a subset).
    """
    import torch

    z = x.double() * scale
    if causal:
        z = z.masked_fill(causal_future(z.shape[-2], z.shape[-1], z.device, rows), -math.inf)
    elif mask is not None:
        z = torch.where(mask.to(z.device), torch.tensor(MASKED_VALUE, dtype=torch.float64, device=z.device), z)
    if z.numel() == 0:
        return z
    m = z.max(-1, keepdim=True).values
    e = torch.exp(z - m)
    y = e / e.sum(-1, keepdim=True)
    if mask is not None and not causal and fully_masked_rows_are_zero:
        full = mask.to(z.device).expand(z.shape).all(-1, keepdim=True)
        y = torch.where(full, torch.zeros_like(y), y)
    return y


def softmax_backward(g, y, scale: float):
    """dx = scale * (y*g - y*sum(y*g)) in fp64, from the saved (rounded) output."""
    g = g.double()
    y = y.double()
    return scale * (y * g - y * (y * g).sum(-1, keepdim=True))


def backward_size(g, y, scale: float) -> float:
    """Magnitude of the terms the backward formula subtracts: its rounding scale."""
    g = g.double()
    y = y.double()
    if y.numel() == 0:
        return 0.0
    terms = y.abs() * (g.abs() + (y * g).abs().sum(-1, keepdim=True))
    return abs(scale) * terms.max().item()


def max_error(actual, expected) -> float:
    if expected.numel() == 0:
        return 0.0
    return (actual.double().to(expected.device) - expected).abs().max().item()


def core_attention(q, k, v, scale: float, *, causal: bool = False, mask=None, fully_masked_rows_are_zero: bool = True):
    """Megatron's unfused core attention in fp64: ``q`` [sq, b, np, dk], ``k`` [sk, b, ng, dk], ``v``
    [sk, b, ng, dv] (ng divides np: K/V repeated per group, as upstream does), the kernels' softmax
    (:func:`softmax`) between the two GEMMs; context [sq, b, np * dv]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
    probs = softmax(q @ k.transpose(-1, -2), scale, mask=None if causal else mask, causal=causal,
                    fully_masked_rows_are_zero=fully_masked_rows_are_zero)
    out = probs @ v
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
