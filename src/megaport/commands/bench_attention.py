"""``megaport bench --attention``: the port's core attention paths against upstream's unfused one.

Three ways a ported tree can compute Megatron's core attention (query, key and value in, context
out, forward and backward), timed on the same inputs:

* ``sdpa``: the port's one ``scaled_dot_product_attention`` call (rocm_port.sdpa_core_attention),
  what a ported tree runs where upstream asks for the fused softmax (with ``--dropout`` on the CPU,
  its blockwise kernel: SDPA's CPU flash kernel takes no dropout);
* ``port softmax``: two batched GEMMs around the tree's ``FusedScaleMaskSoftmax`` fused path (the
  port's kernel-exact softmax; ``MEGATRON_ROCM_PORT_SDPA=0``);
* ``upstream unfused``: the same GEMMs around ``forward_torch_softmax``, what upstream runs with
  its fusions off.

Times are medians of interleaved runs (the order alternates each round); peak memory is
torch.cuda.max_memory_allocated on GPUs and, on the CPU, the rise of the peak resident set of a
fresh process per variant. The worker runs in a subprocess with the tree first on the path
(``python -m megaport.commands.bench_attention --worker ...``). It measures; it never asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megaport.commands.bench import _load as bench_load
from megaport.errors import MegaportError

VARIANTS = ("sdpa", "port_softmax", "upstream_unfused")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
WORKER_TIMEOUT = 1800


@dataclass
class AttentionBenchOptions:
    tree: Path
    device: str = "auto"
    shapes: str = "2,8,512;2,8,1024;2,8,2048"  # b,heads,seq per shape
    head_dim: int = 64
    groups: int | None = None  # query groups (GQA); None: one per head
    dtypes: str = "bf16,fp32"
    mask: str = "causal"
    dropout: float = 0.0  # attention dropout, every variant
    repeats: int = 5
    warmup: int = 1
    json_file: str | None = None
    python: str | None = None


def _significant(value: float, digits: int = 3) -> float:
    """``value`` to ``digits`` significant digits: SDPA runs 50 times faster than the unfused path at
    short sequences, and a ratio of 0.0197 kept to 3 decimals (0.02) was 1.4 % off."""
    return float(f"{value:.{digits}g}")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"b,heads,seq;b,heads,seq"`` → [(b, heads, seq), ...]."""
    shapes = []
    for part in (p for p in text.replace(" ", "").split(";") if p):
        try:
            dims = tuple(int(v) for v in part.split(","))
        except ValueError:
            dims = ()
        if len(dims) != 3 or min(dims) < 1:
            raise MegaportError(f"--shapes {text!r}: give b,heads,seq per shape, ';' between shapes", exit_code=2)
        shapes.append(dims)
    if not shapes:
        raise MegaportError("--shapes is empty: give b,heads,seq per shape", exit_code=2)
    return shapes


# --- the worker, in the tree's process ----------------------------------------------------------

def _port_module():
    from megaport.smoke import _locate

    module, why = _locate.import_first(_locate.ROCM_PORT_MODULES)
    if module is None or not hasattr(module, "sdpa_core_attention"):
        raise SystemExit(f"this tree's port has no sdpa_core_attention ({why or 'an older port'}): re-apply it "
                         "with this megaport")
    return module


def _variants(args, torch):
    """The three fwd+bwd closures over the same q, k, v and output gradient."""
    from megaport.commands import bench_worker as _bench

    port = _port_module()
    fs, mask_func = _bench.load(Path(args.tree))
    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device("cuda", 0) if args.device != "cpu" else torch.device("cpu")
    b, heads, seq = args.b, args.heads, args.seq
    groups = args.groups or heads
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    q, k, v = tensor(seq, b, heads, args.head_dim), tensor(seq, b, groups, args.head_dim), \
        tensor(seq, b, groups, args.head_dim)
    for t in (q, k, v):
        t.requires_grad_(True)
    grad = tensor(seq, b, heads * args.head_dim)
    scale = 1.0 / math.sqrt(args.head_dim)
    causal = args.mask == "causal"
    padding = (torch.rand((b, 1, seq, seq), generator=gen) < 0.1).to(device) if args.mask == "padding" else None
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1).view(1, 1, seq, seq)
    softmax = _bench.build(fs, mask_func, args.mask, dtype, torch)

    def gemms_around(probabilities):
        kk, vv = (t.repeat_interleave(heads // groups, dim=2) if groups != heads else t for t in (k, v))
        scores = torch.baddbmm(torch.empty(b * heads, seq, seq, dtype=dtype, device=device),
                               q.reshape(seq, b * heads, -1).transpose(0, 1),
                               kk.reshape(seq, b * heads, -1).transpose(0, 1).transpose(1, 2),
                               beta=0.0, alpha=scale / softmax.scale)
        probs = probabilities(scores.view(b, heads, seq, seq))
        if args.dropout:  # upstream's self.attention_dropout(attention_probs)
            probs = torch.nn.functional.dropout(probs, args.dropout)
        context = torch.bmm(probs.view(b * heads, seq, seq), vv.reshape(seq, b * heads, -1).transpose(0, 1))
        context.view(b, heads, seq, -1).permute(2, 0, 1, 3).reshape(seq, b, -1).backward(grad)

    def sdpa():
        port.sdpa_core_attention(q, k, v, scale=scale, causal=causal, mask=padding, dropout_p=args.dropout,
                                 fully_masked_rows_are_zero=port.FULLY_MASKED_ROWS_ARE_ZERO).backward(grad)

    def port_softmax():
        gemms_around(lambda s: softmax.forward_fused_softmax(s, None if causal else padding))

    def upstream_unfused():
        gemms_around(lambda s: softmax.forward_torch_softmax(s, causal_mask if causal else padding))

    def clear():
        for t in (q, k, v):
            t.grad = None

    blockwise = getattr(port, "blockwise_wanted", lambda *_: False)(device, args.dropout, causal)
    backend = "blockwise" if blockwise else port.sdpa_backend(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), None,
                                                              args.dropout, causal, scale, groups != heads)
    return {"sdpa": sdpa, "port_softmax": port_softmax, "upstream_unfused": upstream_unfused}, clear, device, backend


def _time(args, torch) -> dict:
    from megaport.commands import bench_worker as _bench

    variants, clear, device, backend = _variants(args, torch)
    samples = _bench.interleaved_ms(variants, warmup=args.warmup, repeats=args.repeats, before_each=clear,
                                    torch=torch, device=device)
    memory = _bench.gpu_peak_mib(variants, before_each=clear, torch=torch, device=device)
    return {"ms": {n: statistics.median(v) for n, v in samples.items()}, "samples_ms": samples,
            "peak_mib": memory or None, "sdpa_backend": backend, "threads": torch.get_num_threads()}


def _memory(args, torch) -> dict:
    from megaport.commands import bench_worker as _bench

    variants, clear, _, _ = _variants(args, torch)
    run = variants[args.variant]
    run()
    clear()
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return {"peak_mib": None}
    base = _bench._status_kib("VmRSS")
    run()
    peak = _bench._status_kib("VmHWM")
    return {"peak_mib": None if base is None or peak is None else (peak - base) / 1024}


def worker(argv=None) -> int:
    parser = argparse.ArgumentParser()
    for name in ("--tree", "--device", "--dtype", "--mask"):
        parser.add_argument(name, required=True)
    for name in ("--b", "--heads", "--seq", "--head-dim", "--groups", "--repeats", "--warmup"):
        parser.add_argument(name, type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--variant", choices=VARIANTS)
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)
    import torch

    result = _memory(args, torch) if args.variant else _time(args, torch)
    print(json.dumps(result), flush=True)
    return 0


# --- the command ----------------------------------------------------------------------------------

def _run_worker(python: str, tree: Path, env: dict, argv: list, what: str) -> dict:
    command = [python, "-W", "ignore", "-m", "megaport.commands.bench_attention", "--worker", "--tree", str(tree),
               *argv]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(tree), timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise MegaportError(f"attention bench worker ({what}) ran longer than {WORKER_TIMEOUT} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = "; ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise MegaportError(f"attention bench worker ({what}) failed: {tail or 'no output'}")


def bench_attention(options: AttentionBenchOptions, console) -> int:
    from megaport import device as devices
    from megaport.porttree import ported_tree, subprocess_env
    from megaport.report import write_json

    python = options.python or sys.executable
    tree, state = ported_tree(options.tree)
    shapes = parse_shapes(options.shapes)
    dtypes = [d.strip() for d in options.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise MegaportError(f"--dtype {options.dtypes!r}: choose from {', '.join(DTYPES)}", exit_code=2)
    if options.groups and any(h % options.groups for _, h, _ in shapes):
        raise MegaportError(f"--groups {options.groups} must divide every shape's heads", exit_code=2)
    info = devices.probe_subprocess(python)
    devices.require_torch(info, python)
    kind = devices.resolve_device(options.device, info)
    env = subprocess_env(tree)
    # Memory workers only: large blocks straight from mmap, returned when freed, so the resident set
    # follows what a variant holds. Timed with it, a variant that allocates per block pays a page
    # fault per page (the blockwise kernel: 686 ms against 377 ms without, [2, 4, 2048, 64] fp16).
    memory_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
    console.print(f"attention bench {tree} ({state.series}, {state.upstream_ref}) on {kind}: head dim "
                  f"{options.head_dim}, {options.mask} mask, attention dropout {options.dropout:g}, {options.repeats} "
                  "interleaved fwd+bwd runs per variant")
    rows = []
    for (b, heads, seq) in shapes:
        for dtype in dtypes:
            common = ["--device", kind, "--dtype", dtype, "--mask", options.mask, "--b", str(b), "--heads",
                      str(heads), "--seq", str(seq), "--head-dim", str(options.head_dim), "--groups",
                      str(options.groups or heads), "--dropout", str(options.dropout)]
            timing = _run_worker(python, tree, env, [*common, "--repeats", str(options.repeats), "--warmup",
                                                     str(options.warmup)], f"{b},{heads},{seq} {dtype}")
            peak = timing.get("peak_mib") or {}
            if kind == "cpu":  # a fresh process per variant: the rise of its own peak resident set
                peak = {v: _run_worker(python, tree, memory_env, [*common, "--variant", v], f"memory {v}")["peak_mib"]
                        for v in VARIANTS}
            row = {"b": b, "heads": heads, "seq": seq, "dtype": dtype, "sdpa_backend": timing["sdpa_backend"],
                   "threads": timing["threads"], "samples_ms": timing["samples_ms"]}
            for v in VARIANTS:
                row[f"{v}_ms"] = _significant(timing["ms"][v], 4)
                row[f"{v}_peak_mib"] = None if peak.get(v) is None else round(peak[v], 1)
            unfused = timing["ms"]["upstream_unfused"]
            row["sdpa_vs_unfused"] = _significant(timing["ms"]["sdpa"] / unfused)
            row["port_softmax_vs_unfused"] = _significant(timing["ms"]["port_softmax"] / unfused)
            if row["sdpa_peak_mib"] is not None and row["upstream_unfused_peak_mib"]:
                row["sdpa_memory_vs_unfused"] = round(row["sdpa_peak_mib"] / row["upstream_unfused_peak_mib"], 3)
            rows.append(row)
            console.print(_line(row))
    document = {"tree": str(tree), "series": state.series, "upstream": {"ref": state.upstream_ref,
                "sha": state.upstream_sha}, "device": {**info, "device": kind}, "head_dim": options.head_dim,
                "groups": options.groups, "mask": options.mask, "dropout": options.dropout, "repeats": options.repeats,
                "load_average": {"load": bench_load(), "cpus": os.cpu_count()}, "variants": {
                    "sdpa": "rocm_port.sdpa_core_attention: one scaled_dot_product_attention call (the port's "
                            "blockwise kernel for attention dropout where SDPA's flash kernel takes none)",
                    "port_softmax": "baddbmm + FusedScaleMaskSoftmax.forward_fused_softmax (the port's kernel-exact "
                                    "softmax) + bmm",
                    "upstream_unfused": "baddbmm + FusedScaleMaskSoftmax.forward_torch_softmax (upstream's unfused "
                                        "path, causal mask precomputed and not timed) + bmm"},
                "results": rows}
    write_json(options.json_file, document)
    return 0


def _line(row: dict) -> str:
    def peak(v):
        value = row.get(f"{v}_peak_mib")
        return "-" if value is None else f"{value:.0f} MiB"

    memory = f", memory {row['sdpa_memory_vs_unfused']:.3g}x" if row.get("sdpa_memory_vs_unfused") else ""
    return (f"[{row['b']},{row['heads']},{row['seq']}] {row['dtype']}: sdpa ({row['sdpa_backend']}) "
            f"{row['sdpa_ms']:.2f} ms {peak('sdpa')} | port softmax {row['port_softmax_ms']:.2f} ms "
            f"{peak('port_softmax')} | upstream unfused {row['upstream_unfused_ms']:.2f} ms "
            f"{peak('upstream_unfused')} | sdpa/unfused {row['sdpa_vs_unfused']:.3g}x{memory}, "
            f"port softmax/unfused {row['port_softmax_vs_unfused']:.3g}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2:]))
    raise SystemExit("run `megaport bench --attention`; this module's entry point is the worker")
