"""Checkpoint keys in either spelling: where upstream's TE layer spec and its local spec (which the
port builds in TE's place) name the same weight differently, a ``torch_dist`` checkpoint written
with the other spelling loads all the same, said once.

TransformerEngine fuses a norm into the linear after it (``LayerNormColumnParallelLinear``: the
norm's weight is that linear's ``layer_norm_weight``); the local spec builds the norm apart and
maps some of them, not all, to TE's key (its ``sharded_state_dict_keys_map``). Upstream's ModelOpt
spec (``get_gpt_modelopt_spec(remap_te_layernorm=True)``, core 0.13 on) states TE's spelling of
each: the same rows as :data:`SPELLINGS`. A Mixtral or DeepSeek checkpoint written on a machine
with TE therefore names its MoE layers' pre-MLP norm ``pre_mlp_layernorm.`` where the local spec
asks for ``mlp.linear_fc1.layer_norm_``, and its MLA q/kv norms inside the up projections; the
reverse holds for checkpoints the port writes, read by TE. The load asks for each shard under the
key the run's own layers give it; a shard the checkpoint lacks under that key is read under the
other spelling of its row, where the checkpoint has that shard. What the run writes is unchanged.
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

from .say import say_once


class Spelling(NamedTuple):
    """One weight's two names in a layer: the local spec's separate norm and TE's fused one."""
    what: str
    local: str
    te: str


#: Where TE's layer specs and the local ones spell a layer's norm differently (upstream's ModelOpt
#: spec maps the same rows): each key fragment starts a module path inside a transformer layer.
SPELLINGS = (
    Spelling("the attention's input norm", "input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    Spelling("the pre-MLP norm (MoE layers, and MLA's dense layers)", "pre_mlp_layernorm.",
             "mlp.linear_fc1.layer_norm_"),
    Spelling("MLA's query norm", "self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
    Spelling("MLA's key-value norm", "self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),
    # the port's norm + linear in TE's place (MLA's query projection without --q-lora-rank, 2026 on)
    Spelling("the port's fused norm + linear", ".layer_norm.", ".layer_norm_"),
)


def _other_spellings(key: str):
    """(row, the key in that row's other spelling) for each row ``key`` has a fragment of."""
    for row in SPELLINGS:
        for mine, other in ((row.local, row.te), (row.te, row.local)):
            boundary = "" if mine.startswith(".") else r"(?:^|(?<=\.))"
            found = re.search(boundary + re.escape(mine), key)
            if found:
                yield row, key[:found.start()] + other + key[found.end():]


def _has_shard(saved: dict, key: str, shard) -> bool:
    """Whether the checkpoint (``saved``: key -> the offsets of its chunks, None for non-tensors) holds
    ``shard`` under ``key``: the chunk at its offsets along the stacked axes (layers, experts)."""
    if key not in saved:
        return False
    stacked = getattr(shard, "prepend_axis_num", 0) or 0
    chunks = saved[key]
    if not stacked or chunks is None:
        return True
    want = tuple(shard.global_offset[:stacked])
    return any(tuple(offsets[:stacked]) == want for offsets in chunks)


def _shards(tree):
    """Every ShardedTensor (what has a key and a global offset) in a nested state dict."""
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (list, tuple)):
        if hasattr(tree, "key") and hasattr(tree, "global_offset"):
            yield tree
        return
    for value in tree:
        yield from _shards(value)


def respell(sharded_state_dict, saved: dict) -> list:
    """Point each shard ``saved`` lacks under its own key at its other spelling where ``saved`` has
    it, in place; the (row, key read, key the run writes) of each shard changed."""
    changed = []
    for shard in _shards(sharded_state_dict):
        if _has_shard(saved, shard.key, shard):
            continue
        for row, other in _other_spellings(shard.key):
            if _has_shard(saved, other, shard):
                changed.append((row, other, shard.key))
                shard.key = other
                break
    return changed


def _saved_chunks(checkpoint_dir) -> dict | None:
    """key -> chunk offsets (None for a non-tensor) of a ``torch_dist`` checkpoint; None for another format."""
    if not os.path.isfile(os.path.join(str(checkpoint_dir), ".metadata")):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    return {key: ([tuple(c.offsets) for c in item.chunks] if hasattr(item, "chunks") else None)
            for key, item in metadata.items()}


def _say_spellings(changed: list) -> None:
    """One line: which spelling the checkpoint had, row by row, and which the run writes."""
    rows = {}
    for row, read, wrote in changed:
        rows.setdefault(row, (read, wrote))
    said = "; ".join(f"{row.what}: read as '{_fragment(read, row)}', written as '{_fragment(wrote, row)}'"
                     for row, (read, wrote) in rows.items())
    say_once(f"the checkpoint spells {len(changed)} weights as the other layer spec does "
             f"(TransformerEngine's fused norms or the local spec's separate ones): {said}")


def _fragment(key: str, row: Spelling) -> str:
    return row.te if row.te in key else row.local


def _checkpoints_read_either_spelling(module) -> None:
    """``dist_checkpointing.load`` (core 0.5 on) reads a shard the checkpoint lacks under the run's
    key under its other spelling (:data:`SPELLINGS`), said once."""
    load = getattr(module, "load", None)
    if load is None or getattr(load, "_rocm_port_spellings", False):
        return

    @functools.wraps(load)
    def served(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        saved = _saved_chunks(checkpoint_dir)
        changed = respell(sharded_state_dict, saved) if saved is not None else []
        if changed:
            _say_spellings(changed)
        return load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    served._rocm_port_spellings = True
    module.load = served
