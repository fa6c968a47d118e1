"""``megaport bench --train``: training speed and memory of the port against upstream with its
fusions off, on the same machine, config and seed.

Both runs are fresh processes: on a GPU with a Megatron-LM clone, upstream's own pretrain_gpt.py
under torchrun with the example script's flags, shrunk (megaport.smoke._pretrain); elsewhere
megaport.smoke._gpt on upstream's megatron.core builders (see its docstring). The ported tree runs
with upstream's default fusions, and the tree's own upstream commit, exported next to it, with the
fusions turned off (what a ROCm user without megaport runs). Rounds alternate the order. Reported
side by side: ms/iter (median after warm-up), tokens/s, peak device memory (process peak RSS on
CPU), the loss at every step, and the ratios. It measures; it never asserts.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from megaport import device as devices
from megaport.commands.verify import ported_tree, require_torch, resolve_device, subprocess_env
from megaport.errors import MegaportError
from megaport.report import write_json

# Sizes when none are given: the issue's GPU config on a GPU, a small model that runs in about a
# minute on a 2-core CPU.
GPU_SIZES = dict(layers=8, hidden=2048, heads=16, seq=2048, batch=4, steps=30, warmup=5, vocab=32000)
CPU_SIZES = dict(layers=2, hidden=256, heads=4, seq=512, batch=2, steps=12, warmup=2, vocab=1024)


@dataclass
class TrainBenchOptions:
    tree: Path
    device: str = "auto"
    sizes: dict | None = None
    rounds: int = 1
    json_file: str | None = None
    python: str | None = None
    entry: str = "auto"


def bench_train(options: TrainBenchOptions, console) -> int:
    from megaport.smoke import _gpt

    python = options.python or sys.executable
    tree, state = ported_tree(options.tree)
    info = devices.probe_subprocess(python)
    require_torch(info, python)
    kind = resolve_device(options.device, info)
    sizes = dict(GPU_SIZES if kind != "cpu" else CPU_SIZES)
    sizes.update({k: v for k, v in (options.sizes or {}).items() if v is not None})
    sizes["device"] = "cpu" if kind == "cpu" else "cuda"
    if sizes["hidden"] % sizes["heads"]:
        raise MegaportError(f"--hidden {sizes['hidden']} is not a multiple of --heads {sizes['heads']}", exit_code=2)
    if sizes["warmup"] >= sizes["steps"]:
        raise MegaportError(f"--warmup {sizes['warmup']} leaves no timed step of --steps {sizes['steps']}",
                            exit_code=2)
    entry = _entry(options.entry, kind, tree)
    env = subprocess_env(tree)
    console.print(f"bench --train {tree} ({state.series}, {state.upstream_ref}) on {kind} through "
                  f"{ENTRIES[entry]}: " + ", ".join(f"{k} {v}" for k, v in sizes.items() if k != "device"))
    ported_runs, upstream_runs, against = [], [], None
    with console.status("") as status:
        for r in range(options.rounds):
            for which in (("ported", "upstream") if r % 2 == 0 else ("upstream", "ported")):
                status.update(f"round {r + 1}/{options.rounds}: {which} "
                              f"({'port, default fusions' if which == 'ported' else 'upstream, fusions off'})")
                try:
                    if entry == "pretrain":
                        run, what = _pretrain_side(tree, state.upstream_sha, which, env, sizes)
                    elif which == "ported":
                        run, what = _gpt.run_in_subprocess(tree, "ported", env=env, **sizes), None
                    else:
                        run, what = _gpt.upstream_baseline(tree, state.upstream_sha, env, **sizes)
                except RuntimeError as exc:
                    raise MegaportError(f"bench --train: {exc}") from None
                (ported_runs if which == "ported" else upstream_runs).append(run)
                against = what or against
    document = _document(tree, state, kind, info, sizes, ported_runs, upstream_runs, against)
    _table(console, document)
    write_json(options.json_file, document)
    return 0


ENTRIES = {"pretrain": "upstream's pretrain_gpt.py under torchrun",
           "harness": "megaport's harness on upstream's megatron.core builders"}


def _entry(requested: str, kind: str, tree: Path) -> str:
    """pretrain_gpt.py where it can run (a GPU, a Megatron-LM clone), else the harness."""
    runnable = kind != "cpu" and (tree / "pretrain_gpt.py").is_file()
    if requested == "pretrain" and not runnable:
        why = "upstream's training loop needs a GPU" if kind == "cpu" else f"{tree} has no pretrain_gpt.py"
        raise MegaportError(f"--entry pretrain: {why}; use --entry harness", exit_code=2)
    if requested == "auto":
        return "pretrain" if runnable else "harness"
    return requested


def _pretrain_side(tree: Path, sha: str, which: str, env: dict, sizes: dict) -> tuple[dict, str | None]:
    """One side through upstream's pretrain_gpt.py: the ported tree with the example's flags, or
    the unported commit (exported next to it) with the fusions turned off."""
    from megaport.smoke import _gpt, _pretrain

    run_sizes = {k: v for k, v in sizes.items() if k in ("layers", "hidden", "heads", "seq", "batch", "steps",
                                                        "warmup", "vocab")}
    if which == "ported":
        result = _pretrain.run_pretrain(str(tree), _gpt.Run(tree=str(tree), mode="ported", device="cuda",
                                                            **run_sizes), env)
        what = None
    else:
        with _gpt.exported_upstream(tree, sha) as (upstream, plain):
            result = _pretrain.run_pretrain(upstream, _gpt.Run(tree=upstream, mode="fusions-off", device="cuda",
                                                               **run_sizes), plain)
        what = "unported upstream's pretrain_gpt.py, fusions off"
    return {**result, "peak_memory_bytes": result["peak_memory_bytes"] or 0,
            "peak_memory_kind": "max allocated, from upstream's memory report",
            "fusions_after_config": "upstream's defaults (the example's flags)",
            "layer_spec": "pretrain_gpt.py's model provider", "optimizer": "upstream's optimizer",
            "substitutions": []}, what


def _summary(runs: list) -> dict:
    return {
        "ms_per_iter": statistics.median(r["ms_per_iter"] for r in runs),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs),
        "losses": runs[0]["losses"],
        "ms_per_iter_each_round": [round(r["ms_per_iter"], 3) for r in runs],
    }


def _document(tree, state, kind, info, sizes, ported_runs, upstream_runs, against) -> dict:
    ported, upstream = _summary(ported_runs), _summary(upstream_runs)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ported["losses"], upstream["losses"]))
    return {
        "tree": str(tree),
        "series": state.series,
        "upstream": {"ref": state.upstream_ref, "sha": state.upstream_sha},
        "device": {**info, "device": kind},
        "sizes": sizes,
        "rounds": len(ported_runs),
        "ported": {**ported, "fusions": ported_runs[0]["fusions_after_config"],
                   "layer_spec": ported_runs[0]["layer_spec"], "optimizer": ported_runs[0]["optimizer"],
                   "log": ported_runs[0].get("log", [])},
        "upstream_fusions_off": {**upstream, "what": against},
        "ratio": {
            "ms_per_iter": ported["ms_per_iter"] / upstream["ms_per_iter"],
            "tokens_per_s": ported["tokens_per_s"] / upstream["tokens_per_s"],
            "peak_memory": (ported["peak_memory_bytes"] / upstream["peak_memory_bytes"]
                            if upstream["peak_memory_bytes"] else None),
        },
        "loss_max_relative_difference": worst,
        "peak_memory_kind": ported_runs[0]["peak_memory_kind"],
        "substitutions": ported_runs[0]["substitutions"],
    }


def _table(console, document: dict) -> None:
    from rich.table import Table

    ported, upstream, ratio = document["ported"], document["upstream_fusions_off"], document["ratio"]
    table = Table(title=f"training, median of {document['rounds']} round(s), ms/iter after warm-up",
                  title_justify="left")
    for column in ("", "ported (default fusions)", "upstream, fusions off", "ratio"):
        table.add_column(column, justify="left" if not column else "right")
    mib = 2**20
    table.add_row("ms/iter", f"{ported['ms_per_iter']:.1f}", f"{upstream['ms_per_iter']:.1f}",
                  f"{ratio['ms_per_iter']:.2f}x")
    table.add_row("tokens/s", f"{ported['tokens_per_s']:.0f}", f"{upstream['tokens_per_s']:.0f}",
                  f"{ratio['tokens_per_s']:.2f}x")
    table.add_row(f"peak memory MiB ({document['peak_memory_kind']})", f"{ported['peak_memory_bytes'] / mib:.0f}",
                  f"{upstream['peak_memory_bytes'] / mib:.0f}",
                  f"{ratio['peak_memory']:.2f}x" if ratio["peak_memory"] is not None else "n/a")
    console.print(table)
    losses = Table(title="loss per step (same seed and batches)", title_justify="left")
    for column in ("step", "ported", "upstream", "relative difference"):
        losses.add_column(column, justify="right")
    for step, (a, b) in enumerate(zip(ported["losses"], upstream["losses"]), start=1):
        losses.add_row(str(step), f"{a:.4f}", f"{b:.4f}", f"{abs(a - b) / abs(b):.1e}")
    console.print(losses)
    console.print(f"upstream run: {upstream['what']}")
    console.print(f"ported run: {ported['layer_spec']}; {ported['optimizer']}")
    for line in ported.get("log") or []:
        console.print(line)
    if document["substitutions"]:
        console.print("CPU substitutions: " + "; ".join(document["substitutions"]))
