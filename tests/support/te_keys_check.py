"""Run inside a ported tree (cwd on sys.path, one gloo rank): a checkpoint written with TE's key
spelling loads into the ported model with the same weights.

Usage: python -m megaport.train.launch --cpu te_keys_check.py FOLDER moe mla → one JSON line, by model.

A tiny Mixtral-style (MoE) or DeepSeek-style (MLA with q LoRA and q/kv norms, a dense first layer,
then MoE) model is built as ``pretrain_gpt.py`` builds it with upstream's default
``--transformer-impl transformer_engine`` (the port builds the local layers). Its sharded state dict
is saved twice with ``torch_dist``: as the ported tree writes it, and with each layer's keys spelled
as TE's spec writes them, the map read from upstream's own ModelOpt spec
(``get_gpt_modelopt_spec(config, remap_te_layernorm=True)``, whose layer specs map the local
modules to TE's fused-norm keys). A fresh model (other seed) loads each through the tree's
``dist_checkpointing.load``: every weight equal to the saved model's. A load that fails exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import torch


def _config(kind: str):
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
                  add_bias_linear=False, gated_linear_unit=True, use_cpu_initialization=True, num_moe_experts=2,
                  moe_router_topk=2, moe_ffn_hidden_size=48, attention_dropout=0.0, hidden_dropout=0.0,
                  transformer_impl="transformer_engine")
    from megatron.core.transformer import transformer_config

    if kind == "mla":
        common.update(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                      qk_pos_emb_head_dim=8, v_head_dim=8, moe_layer_freq=[0, 1], rope_type="rope")
    cls = transformer_config.MLATransformerConfig if kind == "mla" else transformer_config.TransformerConfig
    known = {f.name for f in dataclasses.fields(cls)}  # transformer_impl: core 0.16 on
    return cls(**{k: v for k, v in common.items() if k in known})


def _model(config, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=config.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                    position_embedding_type="rope")


def _te_maps(config) -> list:
    """Each layer's map from the local modules' names to TE's keys: upstream's ModelOpt spec."""
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    block = get_gpt_modelopt_spec(config, local_core_attention=True, remap_te_layernorm=True)
    return [dict(spec.submodules.sharded_state_dict_keys_map) for spec in block.layer_specs]


def _mapped(name: str, mapping: dict) -> str:
    """``name`` as upstream's apply_prefix_mapping renames it."""
    for old, new in mapping.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _te_spelled(model, sharded_state_dict, maps: list) -> dict:
    """The ported tree's keys of the layers' names that its spec or TE's maps, respelled as TE's map
    does, in place: {ported key: TE key} of those changed."""
    changed = {}
    for name, shard in sharded_state_dict.items():
        found = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
        if found is None or not hasattr(shard, "key"):
            continue
        layer, inside = int(found.group(1)), found.group(2)
        ported_map = model.decoder.layers[layer].submodules_config.sharded_state_dict_keys_map
        if not any(inside.startswith(prefix) for prefix in (*ported_map, *maps[layer])):
            continue
        ported = _mapped(inside, ported_map)
        assert shard.key.endswith(ported), (shard.key, ported)
        te = shard.key[:len(shard.key) - len(ported)] + _mapped(inside, maps[layer])  # stacked or per layer
        if te != shard.key:
            changed[shard.key] = te
            shard.key = te
    return changed


def _loaded(config, folder: str) -> dict:
    from megatron.core import dist_checkpointing

    model = _model(config, seed=99)
    state = dist_checkpointing.load(model.sharded_state_dict(), folder)
    model.load_state_dict(state)
    return model.state_dict()


def _largest_difference(saved: dict, loaded: dict) -> float:
    return max(((saved[k].float() - loaded[k].float()).abs().max().item()
                for k in saved if isinstance(saved[k], torch.Tensor) and not k.endswith("_extra_state")), default=0.0)


def _check(kind: str, folder: str) -> dict:
    """Save ``kind``'s model in both spellings; each loaded into a fresh model: the largest difference."""
    from megatron.core import dist_checkpointing

    config = _config(kind)
    model = _model(config, seed=1)
    saved = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    result = {}
    for spelling in ("ported", "te"):
        where = os.path.join(folder, kind, spelling)
        os.makedirs(where)
        sharded = model.sharded_state_dict()
        if spelling == "te":
            result["respelled"] = _te_spelled(model, sharded, _te_maps(config))
        dist_checkpointing.save(sharded, where)
        result[spelling] = _largest_difference(saved, _loaded(config, where))
    return result


def main() -> int:
    folder, kinds = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, os.getcwd())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29657"), RANK="0",
                      WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    print(json.dumps({kind: _check(kind, folder) for kind in kinds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
