"""``megaport bench --fusions``: what each fusion TransformerEngine would give costs without it.

A ROCm box without TransformerEngine runs RoPE, SwiGLU, RMSNorm and the cross-entropy unfused, in
upstream's own PyTorch forms. This bench times each of them forward plus backward at one Llama-style
layer's shapes, eagerly (what runs) and through ``torch.compile`` (what a fused kernel would come
close to), beside the layer's GEMMs and its core attention (SDPA), and gives each one's estimated
share of a training iteration: its time times how often an iteration runs it (per layer: two
norms, RoPE on query and key, one SwiGLU; per iteration: the final norm and one cross-entropy over
the vocabulary). Estimates, not a profile: the ops run alone here. On a CPU ``torch.compile``
writes C++ (never the port's default there); on a GPU, Triton. It measures; it never asserts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from megaport.errors import MegaportError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class FusionBenchOptions:
    device: str = "auto"
    seq: int = 2048
    batch: int = 1
    hidden: int = 1024
    heads: int = 16
    groups: int = 4
    ffn: int | None = None  # None: Llama's ratio, 8/3 of hidden rounded up to 64
    vocab: int = 32000
    layers: int = 2
    dtype: str = "bf16"
    repeats: int = 5
    compile: bool = True
    json_file: str | None = None


def rms_norm(x, weight, eps=1e-5):
    """Upstream's torch RMSNorm (WrappedTorchNorm: torch.nn.RMSNorm)."""
    import torch

    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(x):
    """Upstream's unfused SwiGLU (the MLP's ``glu``): silu of one half times the other."""
    import torch

    a, b = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(a) * b


def rope(t, freqs):
    """Upstream's unfused RoPE (``_apply_rotary_pos_emb_bshd``): t * cos + rotate_half(t) * sin."""
    import torch

    x1, x2 = torch.chunk(t, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return t * torch.cos(freqs).to(t.dtype) + rotated * torch.sin(freqs).to(t.dtype)


def cross_entropy(logits, target):
    """Upstream's vocab-parallel cross-entropy at one rank: fp32 logits, mean loss."""
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), target)


def _cases(o: FusionBenchOptions, torch, device, dtype):
    """name -> (function, input builder, how many an iteration runs)."""
    head_dim = o.hidden // o.heads
    gen = torch.Generator().manual_seed(0)

    def t(*shape, grad=True, kind=dtype):
        value = torch.randn(shape, generator=gen).to(kind).to(device)
        return value.requires_grad_(grad)

    freqs = t(o.seq, 1, 1, head_dim, grad=False, kind=torch.float32)
    weight = t(o.hidden)
    w_qkv, w_out = t(o.hidden, o.hidden + 2 * o.groups * head_dim), t(o.hidden, o.hidden)
    w_up, w_down = t(o.hidden, 2 * o.ffn), t(o.ffn, o.hidden)
    target = torch.randint(0, o.vocab, (o.seq * o.batch,), generator=gen).to(device)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def gemms(x):  # the layer's four linear layers, forward and backward
        y = x @ w_qkv
        z = y[..., :o.hidden] @ w_out
        u = z @ w_up
        return u[..., :o.ffn] @ w_down

    return {
        "RMSNorm": (lambda x: rms_norm(x, weight), lambda: (t(o.seq, o.batch, o.hidden),), 2 * o.layers + 1),
        "SwiGLU": (swiglu, lambda: (t(o.seq, o.batch, 2 * o.ffn),), o.layers),
        "RoPE (query and key)": (lambda q, k: (rope(q, freqs), rope(k, freqs)),
                                 lambda: (t(o.seq, o.batch, o.heads, head_dim), t(o.seq, o.batch, o.groups, head_dim)),
                                 o.layers),
        "cross-entropy": (lambda x: cross_entropy(x, target), lambda: (t(o.seq * o.batch, o.vocab),), 1),
        "core attention (SDPA)": (sdpa, lambda: (t(o.batch, o.heads, o.seq, head_dim),
                                                  t(o.batch, o.groups, o.seq, head_dim),
                                                  t(o.batch, o.groups, o.seq, head_dim)), o.layers),
        "linear layers (GEMMs)": (gemms, lambda: (t(o.seq, o.batch, o.hidden),), o.layers),
    }


def _time(fn, args, torch, device, repeats: int, warmup: int = 1) -> float:
    """Median ms of fn(*args) forward plus backward, after ``warmup`` calls."""
    samples = []
    for i in range(repeats + warmup):
        for a in args:
            a.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o.float().sum() for o in outs])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def bench_fusions(options: FusionBenchOptions, console) -> int:
    import torch

    from megaport.report import write_json

    if options.dtype not in DTYPES:
        raise MegaportError(f"--dtype {options.dtype!r}: choose one of {', '.join(DTYPES)}", exit_code=2)
    if options.hidden % options.heads or options.heads % options.groups:
        raise MegaportError("--hidden must be a multiple of --heads, and --heads of --groups", exit_code=2)
    if options.device in ("hip", "cuda") and not torch.cuda.is_available():
        raise MegaportError(f"--device {options.device}: torch sees no GPU; use --device cpu", exit_code=2)
    gpu = options.device in ("hip", "cuda") or (options.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if gpu else "cpu")
    dtype = getattr(torch, DTYPES[options.dtype])
    if options.ffn is None:
        options.ffn = -(-8 * options.hidden // 3 // 64) * 64
    console.print(f"fusions bench on {device.type}: seq {options.seq}, batch {options.batch}, hidden {options.hidden}, "
                  f"{options.heads} heads ({options.groups} groups), ffn {options.ffn}, vocab {options.vocab}, "
                  f"{options.dtype}; shares for {options.layers} layers")
    rows = []
    for name, (fn, make, count) in _cases(options, torch, device, dtype).items():
        args = make()
        eager = _time(fn, args, torch, device, options.repeats)
        compiled = None
        if options.compile and not name.startswith(("core attention", "linear")):
            try:
                compiled = _time(torch.compile(fn), args, torch, device, options.repeats, warmup=3)
            except Exception as exc:  # noqa: BLE001 - no compiler on this machine: say so, keep the eager figure
                console.print(f"{name}: torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        rows.append({"op": name, "per_iteration": count, "eager_ms": round(eager, 3),
                     "compiled_ms": None if compiled is None else round(compiled, 3),
                     "compiled_vs_eager": None if compiled is None else round(compiled / eager, 3)})
    total = sum(r["eager_ms"] * r["per_iteration"] for r in rows)
    for row in rows:
        row["share_of_estimated_iteration"] = round(row["eager_ms"] * row["per_iteration"] / total, 3)
        compiled = "-" if row["compiled_ms"] is None else f"{row['compiled_ms']:.2f} ms ({row['compiled_vs_eager']:.2f}x)"
        console.print(f"{row['op']}: eager {row['eager_ms']:.2f} ms x{row['per_iteration']}, compiled {compiled}, "
                      f"{row['share_of_estimated_iteration']:.0%} of the estimated iteration")
    write_json(options.json_file, {"device": device.type, "torch": torch.__version__, "options": vars(options),
                                   "estimated_iteration_ms": round(total, 3), "results": rows})
    return 0
