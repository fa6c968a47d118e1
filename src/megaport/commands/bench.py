"""``megaport bench``: the tree's replacement softmax against upstream's own torch fallback.

It also times a plain copy of the input on the same device and reports each variant's achieved
bandwidth (the least traffic fwd+bwd must move, over its time) as a fraction of the copy's, and
peak extra memory as a multiple of the input's size.

Both variants are the tree's FusedScaleMaskSoftmax: ``forward_fused_softmax`` (what the port's
replacement functions run) and ``forward_torch_softmax`` (upstream's fallback path), forward and
backward, on the device, in a fresh process with the tree first on the path (commands/bench_worker.py).
Times are medians of interleaved runs (the order alternates each round). Peak memory: on GPUs
torch.cuda.max_memory_allocated; on CPU each variant runs once more in its own process and the
rise of its peak resident set is reported. The bench measures; it never asserts.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megaport import device as devices
from megaport.device import require_torch, resolve_device
from megaport.porttree import ported_tree, subprocess_env
from megaport.errors import MegaportError
from megaport.report import write_json

DTYPE_NAMES = ("bf16", "fp16", "fp32")
WORKER_TIMEOUT = 1800


@dataclass
class BenchOptions:
    tree: Path
    device: str = "auto"
    shape: str = "1,16,1024,1024"
    dtypes: str = "bf16,fp32"
    mask: str = "causal"
    repeats: int = 15
    warmup: int = 2
    json_file: str | None = None
    python: str | None = None
    memory: bool = True
    threads: int | None = None
    extra: dict = field(default_factory=dict)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        dims = [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        dims = []
    if len(dims) == 3:
        dims = [1, *dims]
    if len(dims) != 4 or min(dims) < 1:
        raise MegaportError(f"--shape {text!r}: give b,np,sq,sk (or b*np,sq,sk) as positive integers", exit_code=2)
    return tuple(dims)


def parse_dtypes(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    names = [aliases.get(n, n) for n in names]
    bad = [n for n in names if n not in DTYPE_NAMES]
    if bad or not names:
        raise MegaportError(f"--dtype {text!r}: choose from {', '.join(DTYPE_NAMES)}", exit_code=2)
    return list(dict.fromkeys(names))


def _command(python: str, tree: Path, kind: str, shape: str, dtype: str, mask: str, *extra: str) -> list[str]:
    return [python, "-W", "ignore", "-m", "megaport.commands.bench_worker", "--tree", str(tree), "--device", kind,
            "--shape", shape,
            "--dtype", dtype, "--mask", mask, *extra]


def _parse(proc_stdout: str, stderr: str, what: str) -> dict:
    for line in reversed(proc_stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = "; ".join((stderr or proc_stdout).strip().splitlines()[-3:])
    raise MegaportError(f"bench worker ({what}) failed: {tail or 'no output'}")


def _run_all(command: list[str], env: dict, cwd: Path, what: str, count: int) -> list[dict]:
    """One worker that prints one JSON line per dtype."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise MegaportError(f"bench worker ({what}) ran longer than {WORKER_TIMEOUT} s") from None
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if len(lines) != count:
        _parse("", proc.stderr or proc.stdout, what)  # raises with the worker's last words
    return lines


def _memory_runs(python, tree, kind, shape_text, dtypes, mask, env) -> dict:
    """Each (dtype, variant) once in its own process; the processes run side by side, since each
    measures only its own resident set."""
    menv = dict(env)
    # Large blocks straight from mmap, returned to the system when freed: the resident set then
    # follows what the variant really holds.
    menv.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    menv.setdefault("OMP_NUM_THREADS", "1")  # side by side; threads do not change what is held
    procs = {}
    for dtype in dtypes:
        for variant in ("fused", "torch"):
            procs[(dtype, variant)] = subprocess.Popen(
                _command(python, tree, kind, shape_text, dtype, mask, "--mode", "memory", "--variant", variant),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=menv, cwd=str(tree))
    out: dict = {}
    for (dtype, variant), proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise MegaportError(f"bench memory run ({variant}, {dtype}) ran longer than {WORKER_TIMEOUT} s") from None
        out.setdefault(dtype, {})[variant] = _parse(stdout, stderr, f"memory {variant} {dtype}")
    return out


# Bytes fwd+bwd must move at the least, in units of the input's size: forward reads x and writes
# y; backward reads the gradient and y and writes dx. A copy moves 2 (read and write).
MIN_TRAFFIC = 5


def _bandwidth(timing: dict) -> dict:
    """Achieved bandwidth of each variant (minimum traffic / time) against a plain copy's."""
    size = timing["input_bytes"]
    copy_ms = timing["ms"]["copy"]
    copy_gbps = 2 * size / (copy_ms / 1000) / 1e9
    out = {"copy_ms": round(copy_ms, 3), "copy_gbps": round(copy_gbps, 2), "input_mib": round(size / 2**20, 2)}
    for key, variant in (("replacement", "fused"), ("upstream_torch", "torch")):
        gbps = MIN_TRAFFIC * size / (timing["ms"][variant] / 1000) / 1e9
        out[f"{key}_gbps"] = round(gbps, 2)
        out[f"{key}_bandwidth_vs_copy"] = round(gbps / copy_gbps, 3)
    return out


def _load() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def bench(options: BenchOptions, console) -> int:
    python = options.python or sys.executable
    tree, state = ported_tree(options.tree)
    b, np_, sq, sk = parse_shape(options.shape)
    dtypes = parse_dtypes(options.dtypes)
    if options.mask == "causal" and sq != sk:
        raise MegaportError(f"--causal needs sq == sk (got sq={sq}, sk={sk}); use --mask or --none", exit_code=2)
    info = devices.probe_subprocess(python)
    require_torch(info, python)
    kind = resolve_device(options.device, info)
    env = subprocess_env(tree)
    shape_text = f"{b},{np_},{sq},{sk}"
    console.print(f"bench {tree} ({state.series}, {state.upstream_ref}) on {kind}: [{shape_text}] {options.mask}, "
                  f"{options.repeats} interleaved fwd+bwd runs per variant")
    load_before = _load()
    rows = []
    memory_method = None
    threads = ["--threads", str(options.threads)] if options.threads else []
    timings = _run_all(_command(python, tree, kind, shape_text, ",".join(dtypes), options.mask, "--mode", "time",
                                "--repeats", str(options.repeats), "--warmup", str(options.warmup), *threads),
                       env, tree, "time", len(dtypes))
    cpu_peaks: dict = {}
    if kind == "cpu" and options.memory:
        cpu_peaks = _memory_runs(python, tree, kind, shape_text, dtypes, options.mask, env)
    for dtype, timing in zip(dtypes, timings):
        peak = timing.get("peak_mib")
        memory_method = timing.get("memory_method") or memory_method
        if peak is None and dtype in cpu_peaks:
            peak = {variant: result["peak_mib"] for variant, result in cpu_peaks[dtype].items()}
            memory_method = cpu_peaks[dtype]["fused"]["memory_method"]
        fused_ms, torch_ms = timing["ms"]["fused"], timing["ms"]["torch"]
        row = {
            "dtype": dtype,
            "replacement_ms": round(fused_ms, 3),
            "upstream_torch_ms": round(torch_ms, 3),
            "time_ratio": round(fused_ms / torch_ms, 3) if torch_ms else None,
            # Each round times both variants back to back: the median of the per-round ratios is
            # steadier than the ratio of medians when the machine's load changes during the run.
            "paired_ratio": round(statistics.median(
                f / t for f, t in zip(timing["samples_ms"]["fused"], timing["samples_ms"]["torch"]) if t), 3),
            "replacement_min_ms": round(min(timing["samples_ms"]["fused"]), 3),
            "upstream_torch_min_ms": round(min(timing["samples_ms"]["torch"]), 3),
            "samples_ms": {k: [round(v, 3) for v in vs] for k, vs in timing["samples_ms"].items()},
            "threads": timing.get("threads"),
            **_bandwidth(timing),
        }
        if peak:
            row["replacement_peak_mib"] = round(peak["fused"], 1) if peak.get("fused") is not None else None
            row["upstream_torch_peak_mib"] = round(peak["torch"], 1) if peak.get("torch") is not None else None
            if row["replacement_peak_mib"] is not None and row["upstream_torch_peak_mib"]:
                row["memory_ratio"] = round(row["replacement_peak_mib"] / row["upstream_torch_peak_mib"], 3)
            input_mib = timing["input_bytes"] / 2**20
            for key in ("replacement", "upstream_torch"):
                if row.get(f"{key}_peak_mib") is not None:
                    row[f"{key}_extra_memory_x_input"] = round(row[f"{key}_peak_mib"] / input_mib, 2)
        rows.append(row)
    load_after = _load()
    document = {
        "tree": str(tree),
        "series": state.series,
        "upstream": {"ref": state.upstream_ref, "sha": state.upstream_sha},
        "device": {**info, "device": kind},
        "shape": [b, np_, sq, sk],
        "mask": options.mask,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "variants": {
            "replacement": "FusedScaleMaskSoftmax.forward_fused_softmax (the port's replacement functions; "
                           f"softmax {timings[0].get('port_softmax_path', 'eager')})",
            "upstream_torch": "FusedScaleMaskSoftmax.forward_torch_softmax (upstream's fallback)"
                              + (", causal mask precomputed and not timed" if options.mask == "causal" else ""),
        },
        "memory_method": memory_method,
        "load_average": {"before": load_before, "after": load_after, "cpus": os.cpu_count()},
        "results": rows,
    }
    _table(console, document)
    write_json(options.json_file, document)
    return 0


def _table(console, document: dict) -> None:
    from rich.table import Table

    table = Table(title=f"fwd+bwd, median of {document['repeats']} interleaved runs", title_justify="left")
    for column in ("dtype", "replacement ms", "upstream torch ms", "time ratio", "paired ratio",
                   "replacement peak MiB", "upstream peak MiB", "memory ratio"):
        table.add_column(column, justify="left" if column == "dtype" else "right")

    def fmt(value, spec="{:.2f}"):
        return "-" if value is None else spec.format(value)

    for row in document["results"]:
        table.add_row(row["dtype"], fmt(row["replacement_ms"]), fmt(row["upstream_torch_ms"]),
                      fmt(row["time_ratio"], "{:.2f}x"), fmt(row.get("paired_ratio"), "{:.2f}x"),
                      fmt(row.get("replacement_peak_mib"), "{:.1f}"),
                      fmt(row.get("upstream_torch_peak_mib"), "{:.1f}"), fmt(row.get("memory_ratio"), "{:.2f}x"))
    console.print(table)
    traffic = Table(title=f"against a plain copy of the input ({MIN_TRAFFIC}x the input moved fwd+bwd at the "
                          "least, 2x by a copy); extra memory as a multiple of the input", title_justify="left")
    for column in ("dtype", "input MiB", "copy GB/s", "replacement GB/s", "replacement vs copy",
                   "upstream GB/s", "upstream vs copy", "replacement extra mem", "upstream extra mem"):
        traffic.add_column(column, justify="left" if column == "dtype" else "right")
    for row in document["results"]:
        traffic.add_row(row["dtype"], fmt(row.get("input_mib"), "{:.1f}"), fmt(row.get("copy_gbps")),
                        fmt(row.get("replacement_gbps")), fmt(row.get("replacement_bandwidth_vs_copy"), "{:.0%}"),
                        fmt(row.get("upstream_torch_gbps")), fmt(row.get("upstream_torch_bandwidth_vs_copy"), "{:.0%}"),
                        fmt(row.get("replacement_extra_memory_x_input"), "{:.2f}x"),
                        fmt(row.get("upstream_torch_extra_memory_x_input"), "{:.2f}x"))
    console.print(traffic)
    load = document["load_average"]
    console.print(f"replacement: {document['variants']['replacement']}")
    console.print(f"upstream torch: {document['variants']['upstream_torch']}")
    console.print("time ratio: ratio of the medians; paired ratio: median of each round's replacement/upstream")
    console.print(f"peak memory: {document['memory_method'] or 'not measured'}")
    console.print(f"load average before/after: {load['before']} / {load['after']} on {load['cpus']} CPUs "
                  f"(torch threads: {document['results'][0].get('threads') if document['results'] else '?'})")
