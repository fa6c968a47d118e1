"""``megaport bench --train``: training speed and memory of the port against upstream with its
fusions off, on the same machine, config and seed.

Both runs are fresh processes through the runner verify uses (megaport.train): a Megatron-LM tree
runs its own pretrain_gpt.py under torchrun with the example script's flags, shrunk, on the GPU or
(with the CPU substitutions) on the CPU; a tree without it (PyPI's megatron-core) runs megaport's
harness on upstream's megatron.core builders. The ported tree runs with upstream's default
fusions, and the tree's own upstream commit, exported next to it, with the fusions the era's parser
can turn off turned off (what a ROCm user without megaport runs; baseline shims listed). Rounds
alternate the order. Reported side by side: ms/iter (median after warm-up), tokens/s, peak memory
(torch.cuda.max_memory_allocated at the end of the run, after the optimizer's state exists; the
process's peak RSS on CPU), the loss at every logged iteration, and the ratios. It measures; it
never asserts.
"""

from __future__ import annotations

import functools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from megaport import device as devices
from megaport.device import require_torch, resolve_device
from megaport.porttree import ported_tree, subprocess_env
from megaport.train.preloaded.protocol import ENV as PRELOADED
from megaport.errors import MegaportError
from megaport.report import write_json

# Sizes when none are given: a GPU config where kernels dominate; on a 2-core CPU, a small model
# that runs in about a minute a side. fp16 runs (most example scripts) skip their first ~16
# iterations while the loss scale settles, so the steps leave room for timed iterations after it.
GPU_SIZES = dict(layers=8, hidden=2048, heads=16, seq=2048, batch=4, steps=40, warmup=5, vocab=32000)
CPU_SIZES = dict(layers=2, hidden=256, heads=4, seq=512, batch=2, steps=40, warmup=3, vocab=1024)


@dataclass
class TrainBenchOptions:
    tree: Path
    device: str = "auto"
    sizes: dict | None = None
    rounds: int = 1
    json_file: str | None = None
    python: str | None = None
    entry: str = "auto"
    model: str = "gpt"  # the model family (megaport.train.families)
    layout: str = "one-rank"  # how each side is spread over ranks (megaport.train.layouts)


def bench_train(options: TrainBenchOptions, console) -> int:
    python = options.python or sys.executable
    tree, state = ported_tree(options.tree)
    from megaport.train.families import registry

    if "," in options.model:
        raise MegaportError(f"--model {options.model}: bench --train times one family at a time", exit_code=2)
    family = registry.select(str(tree), options.model)[0]
    missing = family.missing_packages(python)
    if missing:
        raise MegaportError(f"--model {family.name} needs {', '.join(missing)}, which is not "
                            "installed here (the family's layers come from it)", exit_code=2)
    info = devices.probe_subprocess(python)
    require_torch(info, python)
    kind = resolve_device(options.device, info)
    sizes = dict(GPU_SIZES if kind != "cpu" else CPU_SIZES)
    sizes.update({k: v for k, v in (options.sizes or {}).items() if v is not None})
    if sizes["hidden"] % sizes["heads"]:
        raise MegaportError(f"--hidden {sizes['hidden']} is not a multiple of --heads {sizes['heads']}", exit_code=2)
    if sizes["warmup"] >= sizes["steps"]:
        raise MegaportError(f"--warmup {sizes['warmup']} leaves no timed step of --steps {sizes['steps']}",
                            exit_code=2)
    entry = _entry(options.entry, tree, family)
    if entry != "pretrain" and options.layout != "one-rank":
        raise MegaportError(f"--layout {options.layout} needs the tree's own {family.entry_point}; the harness trains "
                            "on one rank", exit_code=2)
    side = (functools.partial(_pretrain_side, family=family.name, layout=options.layout) if entry == "pretrain"
            else _harness_side)
    # every rank a fresh interpreter, as in a user's run: a forked rank's peak RSS counts only the
    # pages it touched (megaport.train.preloaded), and bench compares peak memory
    env = {**subprocess_env(tree), PRELOADED: "0"}
    through = (f"the tree's own {family.entry_point} under torchrun ({family.name})" if entry == "pretrain"
               else ENTRIES[entry])
    console.print(f"bench --train {tree} ({state.series}, {state.upstream_ref}) on {kind} through {through}: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    ported_runs, upstream_runs = [], []
    with console.status("") as status:
        for r in range(options.rounds):
            for which in (("ported", "upstream") if r % 2 == 0 else ("upstream", "ported")):
                status.update(f"round {r + 1}/{options.rounds}: {which} "
                              f"({'port, default fusions' if which == 'ported' else 'upstream, fusions off'})")
                try:
                    run = side(tree, state.upstream_sha, which, env, sizes, "cpu" if kind == "cpu" else "cuda")
                except RuntimeError as exc:
                    raise MegaportError(f"bench --train: {exc}") from None
                (ported_runs if which == "ported" else upstream_runs).append(run)
    document = _document(tree, state, kind, info, sizes, ported_runs, upstream_runs)
    document["model"] = family.name
    _table(console, document)
    write_json(options.json_file, document)
    return 0


ENTRIES = {"pretrain": "the tree's own pretrain_gpt.py under torchrun",
           "harness": "megaport's harness on upstream's megatron.core builders"}


def _entry(requested: str, tree: Path, family=None) -> str:
    """The family's entry point (GPT's by default) where the tree has it, else (GPT only) the harness."""
    if family is None:
        from megaport.train.families import registry

        family = next(f for f in registry.FAMILIES.values() if f.harness)
    has_script = family.has_entry_point(str(tree))
    if not family.harness and requested == "harness":
        raise MegaportError(f"--entry harness trains GPT only; --model {family.name} runs {family.entry_point}",
                            exit_code=2)
    if requested == "pretrain" and not has_script:
        raise MegaportError(f"--entry pretrain: {tree} has no {family.entry_point} (a megatron-core package, not a "
                            "Megatron-LM clone); use --entry harness", exit_code=2)
    if requested == "auto":
        return "pretrain" if has_script else "harness"
    return requested


def _pretrain_side(tree: Path, sha: str, which: str, env: dict, sizes: dict, device: str, *,
                   family: str = "gpt", layout: str = "one-rank") -> dict:
    """One side through the family's entry point (the tree's pretrain_gpt.py for GPT): the ported
    tree with the example's flags, or the unported commit (exported next to it) with the fusions off."""
    from megaport.train import baseline, example, parity, pretrain
    from megaport.train.families import registry

    entry = registry.get(family).entry_point
    shape = example.Sizes(**{k: v for k, v in sizes.items() if k not in ("warmup",)})
    # fp16 examples: upstream's initial loss scale of 2**32 skips the first ~16 steps while it
    # settles, so a short run would log no loss to compare; parity's scale overflows in neither
    run = pretrain.Run(tree=str(tree), mode="ported" if which == "ported" else "fusions-off", device=device,
                       sizes=shape, warmup=sizes["warmup"], family=family, layout=layout,
                       initial_loss_scale=parity.PARITY_LOSS_SCALE)
    if which == "ported":
        return {**pretrain.run_pretrain(run, env), "what": f"the ported tree's {entry}, the example's flags"}
    result, _ = baseline.run_unported(run, sha)
    return {**result, "what": f"the unported upstream commit's {entry}, fusions off"}


def _harness_side(tree: Path, sha: str, which: str, env: dict, sizes: dict, device: str) -> dict:
    from megaport.train.harness import launcher

    if which == "ported":
        run = launcher.run_in_subprocess(tree, "ported", env=env, device=device, **sizes)
        return {**run, "what": "megaport's harness on the ported tree, upstream's default fusions"}
    run, shims = launcher.upstream_baseline(tree, sha, device=device, **sizes)
    return {**run, "baseline_shims": shims, "what": "megaport's harness on the unported upstream commit, fusions off"}


def _summary(runs: list) -> dict:
    first = runs[0]
    steps = first.get("iterations") or list(range(1, len(first["losses"]) + 1))
    return {
        "ms_per_iter": statistics.median(r["ms_per_iter"] for r in runs),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "peak_memory_bytes": max(r["peak_memory_bytes"] or 0 for r in runs),
        "iterations": steps,
        "losses": first["losses"],
        "ms_per_iter_each_round": [round(r["ms_per_iter"], 3) for r in runs],
        "what": first["what"],
    }


def _document(tree, state, kind, info, sizes, ported_runs, upstream_runs) -> dict:
    from megaport.train.parity import loss_parity

    ported, upstream = _summary(ported_runs), _summary(upstream_runs)
    return {
        "tree": str(tree),
        "series": state.series,
        "upstream": {"ref": state.upstream_ref, "sha": state.upstream_sha},
        "device": {**info, "device": kind},
        "sizes": sizes,
        "rounds": len(ported_runs),
        "ported": {**ported, "port_log": ported_runs[0].get("port_log") or ported_runs[0].get("log") or [],
                   "command": ported_runs[0].get("command")},
        "upstream_fusions_off": {**upstream, "baseline_shims": upstream_runs[0].get("baseline_shims") or [],
                                 "command": upstream_runs[0].get("command")},
        "ratio": {
            "ms_per_iter": ported["ms_per_iter"] / upstream["ms_per_iter"],
            "tokens_per_s": ported["tokens_per_s"] / upstream["tokens_per_s"],
            "peak_memory": (ported["peak_memory_bytes"] / upstream["peak_memory_bytes"]
                            if upstream["peak_memory_bytes"] else None),
        },
        "attention": attention_paths(ported_runs[0].get("port_log") or ported_runs[0].get("log") or []),
        "loss_parity": loss_parity(ported, upstream),
        "peak_memory_kind": ported_runs[0].get("peak_memory_kind"),
        "substitutions": ported_runs[0].get("substitutions") or [],
    }


#: What the fusions-off baseline's core attention runs: upstream's own unfused path.
UPSTREAM_ATTENTION = ("upstream's unfused core attention: two batched GEMMs around torch's softmax over the full "
                      "score matrix (--no-masked-softmax-fusion)")


def attention_paths(port_log: list) -> dict:
    """Which core attention each side ran: the ported run's own log lines about it (SDPA and its
    kernel, or the softmax path and why), and upstream's unfused path."""
    said = [line.split("core attention:", 1)[1].strip() for line in port_log if "core attention:" in line]
    return {"ported": said or ["the port's softmax path (this tree's port does not route attention through SDPA)"],
            "upstream_fusions_off": UPSTREAM_ATTENTION}


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
    parity = document["loss_parity"]
    losses = Table(title="loss per logged iteration (same seed, data and flags)", title_justify="left")
    for column in ("iteration", "ported", "upstream", "relative difference"):
        losses.add_column(column, justify="right")
    for step, a, b in zip(parity["iterations"], parity["ported"], parity["upstream"]):
        losses.add_row(str(step), f"{a:.4f}", f"{b:.4f}", f"{abs(a - b) / abs(b):.1e}")
    console.print(losses)
    attention = document.get("attention") or {}
    for line in attention.get("ported") or []:
        console.print(f"ported attention: {line}")
    if attention:
        console.print(f"upstream attention: {attention['upstream_fusions_off']}")
    console.print(f"upstream run: {upstream['what']}")
    for shim in upstream.get("baseline_shims") or []:
        console.print(f"baseline shim: {shim}")
    console.print(f"ported run: {ported['what']}")
    for line in ported.get("port_log") or []:
        console.print(line)
    if document["substitutions"]:
        console.print("CPU substitutions: " + "; ".join(document["substitutions"]))
