"""One rank's legacy checkpoint of a Megatron Core model, split for a layout, where the era has no
checkpoint that reshards itself.

Upstream's yardstick for a layout is one rank's checkpoint loaded in it; from 2024-03 its
distributed checkpoint reshards to any layout. Before, Megatron Core's models (core 0.4-0.5, main
2023-10 … 2024-03) write one file per rank, and the other way to share a start, one
``--use-cpu-initialization`` draw split by rows, gives a layout another model: SwiGLU's fc1 holds
[gate; up] and a row split hands TP rank 0 the gates alone (upstream split it with stride 2 only
from 30694e0cd1, 2025-12-19), and each expert-parallel rank draws its experts from the same
generator state as rank 0 (core_v0.5.0 Llama TP2 31 % in grad norm by iteration 12, Mixtral EP2
81 %, from iteration 1 a model of its own). So one rank writes its checkpoint, and this module
writes each (tensor, expert) rank's file the way that era's layers hold their shards; a shard put
in the wrong place is another model, and the layout comparison fails on it.

The legacy models of the eras before (main 2023-07 … 2023-10 build nothing else) draw one
initialisation on the CPU (``--use-cpu-initialization``) and split it by rows, which is the same
model for GPT but not for a gated unit: their SwiGLU ``dense_h_to_4h`` holds [gate; up] as fc1 does
(main 2023-10's Llama TP2 2.1 % in loss, 66 % in grad norm from that draw; unported upstream in
the same layout 5e-4): one rank's legacy checkpoint is split the same way, its nested keys included.

Upstream's ``tools/checkpoint`` of that era converts legacy models only (``loader_megatron`` /
``saver_megatron``), not Megatron Core's: hence the split here, a table of key patterns
(:data:`SPLITS`), the weights' split dimension read from the era's layers (``ColumnParallelLinear``
dim 0, ``RowParallelLinear`` dim 1, ``VocabParallelEmbedding`` dim 0). The checkpoint pickles the
era's own classes (its arguments' enums), so the split runs in a process with the tree first on
``sys.path`` (:func:`reshard_beside`): ``python -m megaport.train.checks.legacy_reshard SOURCE
TARGET TP EP``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import sys

#: (key pattern, how the weight is split over tensor-parallel ranks): "rows", "columns", "gated rows"
#: (fc1 of a gated unit: its gate and up halves each split by rows), or "whole" (every rank a copy)
SPLITS = (
    (r"(^|\.)word_embeddings\.weight$", "rows"),
    (r"(^|\.)output_layer\.weight$", "rows"),
    # Megatron Core's layers
    (r"\.linear_qkv\.(weight|bias)$", "rows"),  # grouped per query group: a row split is a split by groups
    (r"\.linear_fc1\.(weight|bias)$", "fc1"),
    (r"\.linear_proj\.weight$", "columns"),
    (r"\.linear_fc2\.weight$", "columns"),
    # the legacy model's (megatron/model/transformer.py), its checkpoint nested by module
    (r"\.query_key_value\.(weight|bias)$", "rows"),  # grouped per query group too
    (r"\.dense_h_to_4h\.(weight|bias)$", "fc1"),
    (r"\.self_attention\.dense\.weight$", "columns"),
    (r"\.dense_4h_to_h\.weight$", "columns"),
)

_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_ITERATION = "latest_checkpointed_iteration.txt"


@dataclasses.dataclass(frozen=True)
class Split:
    """The ranks a checkpoint is split over."""

    tensor: int = 1
    expert: int = 1


def rule(key: str, gated: bool) -> str:
    """How ``key``'s tensor is split over tensor-parallel ranks (:data:`SPLITS`; anything else whole)."""
    for pattern, how in SPLITS:
        if re.search(pattern, key):
            return ("gated rows" if gated else "rows") if how == "fc1" else how
    return "whole"


def tensor_shard(value, how: str, rank: int, size: int):
    """Rank ``rank`` of ``size``'s part of one rank's ``value``."""
    import torch

    if size == 1 or how == "whole" or not isinstance(value, torch.Tensor):
        return value
    if how == "rows":
        return value.chunk(size, dim=0)[rank].clone()
    if how == "columns":
        return value.chunk(size, dim=1)[rank].clone()
    gate, up = value.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0).clone()


def expert_shard(model: dict, rank: int, size: int, experts: int) -> dict:
    """The keys expert-parallel rank ``rank`` holds: every non-expert weight, and its experts renumbered locally."""
    if size == 1:
        return dict(model)
    local = experts // size
    kept = {}
    for key, value in model.items():
        found = _EXPERT.search(key)
        if not found:
            kept[key] = value
        elif int(found.group(1)) // local == rank:
            kept[key[:found.start(1)] + str(int(found.group(1)) % local) + key[found.end(1):]] = value
    return kept


def flattened(model: dict, prefix: str = "") -> dict:
    """A checkpoint's model as one dotted key per tensor: the legacy model nests its state by module
    (``language_model`` → ``encoder`` → ``layers.0.mlp.dense_h_to_4h.weight``), Megatron Core's is flat
    (the split here and the TP-copies check read both through it)."""
    flat = {}
    for key, value in model.items():
        if isinstance(value, dict):
            flat.update(flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def nested_like(model: dict, flat: dict, prefix: str = "") -> dict:
    """``flat``'s tensors put back in ``model``'s nesting (keys ``flat`` lacks left out)."""
    out = {}
    for key, value in model.items():
        if isinstance(value, dict):
            out[key] = nested_like(value, flat, f"{prefix}{key}.")
        elif f"{prefix}{key}" in flat:
            out[key] = flat[f"{prefix}{key}"]
    return out


def rank_folder(tensor_rank: int, expert_rank: int, split: Split) -> str:
    """The era's file name for a (tensor, expert) rank (``megatron/checkpointing.get_checkpoint_name``)."""
    return f"mp_rank_{tensor_rank:02d}" + (f"_{expert_rank:03d}" if split.expert > 1 else "")


def reshard(source: str, target: str, split: Split) -> str:
    """Write ``source``'s one-rank legacy checkpoint to ``target`` as ``split``'s ranks load it; returns ``target``."""
    import torch

    iteration = open(os.path.join(source, _ITERATION), encoding="utf-8").read().strip()
    folder = f"iter_{int(iteration):07d}"
    state = torch.load(os.path.join(source, folder, "mp_rank_00", "model_optim_rng.pt"), weights_only=False,
                       map_location="cpu")
    args = state["args"]
    gated = bool(getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False))
    experts = getattr(args, "num_experts", None) or 1
    if experts % split.expert:
        raise ValueError(f"{experts} experts do not split over {split.expert} expert-parallel ranks")
    nested = any(isinstance(value, dict) for value in state["model"].values())
    for expert_rank in range(split.expert):
        held = expert_shard(flattened(state["model"]), expert_rank, split.expert, experts)
        for tensor_rank in range(split.tensor):
            shard = {key: tensor_shard(value, rule(key, gated), tensor_rank, split.tensor) for key, value in held.items()}
            shard = nested_like(state["model"], shard) if nested else shard
            rank_args = copy.copy(args)
            rank_args.tensor_model_parallel_size, rank_args.expert_model_parallel_size = split.tensor, split.expert
            out = os.path.join(target, folder, rank_folder(tensor_rank, expert_rank, split))
            os.makedirs(out, exist_ok=True)
            torch.save({k: v for k, v in state.items() if k not in ("model", "args")} | {"model": shard, "args": rank_args},
                       os.path.join(out, "model_optim_rng.pt"))
    with open(os.path.join(target, _ITERATION), "w", encoding="utf-8") as handle:
        handle.write(iteration)
    return target


def reshard_beside(tree: str, source: str, target: str, split: Split) -> str:
    """:func:`reshard` in a process that imports the tree's classes the checkpoint pickled; returns ``target``."""
    from megaport.train import pretrain

    proc = subprocess.run([sys.executable, "-m", __name__, source, target, str(split.tensor), str(split.expert)],
                          env=pretrain.environment(tree), capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"splitting {source} for TP{split.tensor} x EP{split.expert} failed: "
                           + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return target


if __name__ == "__main__":
    reshard(sys.argv[1], sys.argv[2], Split(int(sys.argv[3]), int(sys.argv[4])))
