"""Worker of ``megaport bench``: time (or measure the memory of) the tree's two softmax paths.

Usage: python -m megaport.commands.bench_worker --tree DIR --device cpu|cuda|hip --shape B,NP,SQ,SK --dtype bf16
       --mask causal|padding|none (--mode time --repeats N | --mode memory --variant fused|torch)

Both paths are the tree's own FusedScaleMaskSoftmax: ``forward_fused_softmax`` (the port's
replacement) and ``forward_torch_softmax`` (upstream's fallback), forward + backward. Prints one
JSON line. Memory mode runs one variant once in this fresh process; on CPU it reports the rise of
the peak resident set (VmHWM, reset through /proc/self/clear_refs) over the resident set before.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def load(tree: Path):
    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # megaport, for the locator helpers
    from megaport.smoke import _locate

    fs, reason = _locate.import_first(_locate.FUSED_SOFTMAX_MODULES)
    if fs is None:
        raise SystemExit(f"no fused_softmax module in {tree}: {reason}")
    mask_func = None
    for name in _locate.MASK_FUNC_MODULES:
        try:
            mask_func = getattr(__import__(name, fromlist=["_"]), "attention_mask_func", None)
        except ImportError:
            continue
        if mask_func is not None:
            break
    if mask_func is None:
        def mask_func(scores, mask):  # upstream's attention_mask_func, for eras that lack one
            scores.masked_fill_(mask, -10000.0)
            return scores
    return fs, mask_func


def build(fs, mask_func, mask_kind, dtype, torch):
    enum = fs.AttnMaskType
    values = {
        "input_in_fp16": dtype == torch.float16,
        "input_in_bf16": dtype == torch.bfloat16,
        "attn_mask_type": enum.causal if mask_kind == "causal" else enum.padding,
        "scaled_masked_softmax_fusion": True,
        "mask_func": mask_func,
        "softmax_in_fp32": True,
        "scale": 0.125,
    }
    params = inspect.signature(fs.FusedScaleMaskSoftmax.__init__).parameters
    return fs.FusedScaleMaskSoftmax(**{k: v for k, v in values.items() if k in params})


_LOADED: dict = {}


def setup(args, torch):
    if "fs" not in _LOADED:
        _LOADED["fs"], _LOADED["mask_func"] = load(Path(args.tree))
    fs, mask_func = _LOADED["fs"], _LOADED["mask_func"]
    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device("cuda", 0) if args.device != "cpu" else torch.device("cpu")
    b, np_, sq, sk = (int(v) for v in args.shape.split(","))
    module = build(fs, mask_func, args.mask, dtype, torch)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((b, np_, sq, sk), generator=gen).to(dtype).to(device).requires_grad_(True)
    g = torch.randn((b, np_, sq, sk), generator=gen).to(dtype).to(device)
    if args.mask == "causal":
        # Given to upstream's fallback precomputed (not timed): its own get_default_causal_mask
        # builds it on 'cuda' at every call.
        torch_mask = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), 1).view(1, 1, sq, sk)
        fused_mask = None
    elif args.mask == "padding":
        torch_mask = fused_mask = (torch.rand((b, 1, sq, sk), generator=gen) < 0.1).to(device)
    else:
        torch_mask = fused_mask = None

    def fused():
        y = module.forward_fused_softmax(x, fused_mask)
        y.backward(g)

    def fallback():
        y = module.forward_torch_softmax(x, torch_mask)
        y.backward(g)

    return {"fused": fused, "torch": fallback}, x, device


def plain_copy(x):
    """A copy of a tensor of the input's size and dtype: the bandwidth yardstick on this device."""
    src = x.detach()
    dst = src.clone()

    def copy():
        dst.copy_(src)

    return copy


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_ms(timed: dict, *, warmup: int, repeats: int, before_each, torch, device) -> dict:
    """Milliseconds of each of ``timed``'s calls, ``repeats`` rounds after ``warmup``, interleaved
    (the order alternates each round, so load that drifts falls on every variant alike)."""
    samples = {name: [] for name in timed}
    order = list(timed)
    for r in range(warmup + repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            before_each()
            sync(torch, device)
            start = time.perf_counter()
            timed[name]()
            sync(torch, device)
            if r >= warmup:
                samples[name].append((time.perf_counter() - start) * 1000)
    return samples


def gpu_peak_mib(variants: dict, *, before_each, torch, device) -> dict:
    """Each variant's peak allocation on the GPU over what was allocated before it ({} on a CPU)."""
    memory = {}
    if device.type != "cuda":
        return memory
    for name, fn in variants.items():
        before_each()
        gc.collect()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        memory[name] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return memory


def time_mode(args, torch) -> dict:
    variants, x, device = setup(args, torch)

    def clear():
        x.grad = None

    samples = interleaved_ms({**variants, "copy": plain_copy(x)}, warmup=args.warmup, repeats=args.repeats,
                             before_each=clear, torch=torch, device=device)
    memory = gpu_peak_mib(variants, before_each=clear, torch=torch, device=device)
    x.grad = None
    return {
        "port_softmax_path": port_softmax_path(device),
        "ms": {name: statistics.median(v) for name, v in samples.items()},
        "samples_ms": samples,
        "peak_mib": memory or None,
        "memory_method": "torch.cuda.max_memory_allocated over the allocation before the run" if memory else None,
        "threads": torch.get_num_threads(),
        "input_bytes": x.numel() * x.element_size(),
    }


def port_softmax_path(device) -> str:
    """Which of the port's softmax paths ran: compiled (one kernel per pass) or eager."""
    port = next((m for name, m in list(sys.modules.items())
                 if name.endswith(".rocm_port") and hasattr(m, "ScaledMaskedSoftmax")), None)
    # the compiled path's switches live in the module that defines the softmax (the port's softmax.py)
    port = sys.modules.get(port.ScaledMaskedSoftmax.__module__, port) if port is not None else None
    if port is None or not hasattr(port, "_compile_wanted"):
        return "eager (this tree's port has no compiled path)"
    if not port._compile_wanted(device):
        return f"eager ({port._COMPILE_ENV}=1 compiles it; auto compiles on GPUs with Triton)"
    if any(fn is None for fn in port._COMPILED.values()):
        return "eager (compiling failed; see the '> ROCm port:' line)"
    return f"compiled, one kernel per pass ({port._COMPILE_ENV}=0 for the eager path)"


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def memory_mode(args, torch) -> dict:
    variants, x, device = setup(args, torch)
    fn = variants[args.variant]
    fn()  # first call: lazy initialisation; its memory is freed before the measurement
    x.grad = None
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        method = "peak RSS rise (VmHWM reset via /proc/self/clear_refs), fresh process per variant"
    except OSError:
        method = "peak RSS rise (ru_maxrss; VmHWM reset unavailable, includes start-up peak)"
    base = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    if base is None or peak is None:
        return {"peak_mib": None, "memory_method": "unavailable: no /proc/self/status"}
    return {"peak_mib": (peak - base) / 1024, "memory_method": method}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--dtype", required=True, help="one dtype, or a comma list in time mode")
    parser.add_argument("--mask", choices=["causal", "padding", "none"], default="causal")
    parser.add_argument("--mode", choices=["time", "memory"], default="time")
    parser.add_argument("--variant", choices=["fused", "torch"], default="fused")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    dtypes = args.dtype.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown dtype {unknown}; choose from {', '.join(DTYPES)}")
    for dtype in dtypes if args.mode == "time" else dtypes[:1]:
        args.dtype = dtype
        result = time_mode(args, torch) if args.mode == "time" else memory_mode(args, torch)
        result.update({"dtype": dtype, "mode": args.mode})
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
