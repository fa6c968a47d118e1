"""Run inside a ported tree (cwd on sys.path): the tree's local DotProductAttention, built the way
MLA builds it (k_channels != v_channels, MLA's softmax scale), against an fp64 causal attention
written here. Prints one JSON line: the largest error relative to the reference's magnitude."""

from __future__ import annotations

import json
import math
import os
import sys

import torch


def reference(q, k, v, scale):
    """[s, b, h, d] causal attention in fp64: softmax(scale * q k^T) v, future keys excluded."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    scores = scale * q @ k.transpose(-1, -2)
    s = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    out = torch.softmax(scores, -1) @ v  # [b, h, s, dv]
    return out.permute(2, 0, 1, 3).reshape(s, out.shape[0], -1)


def main() -> int:
    sys.path.insert(0, os.getcwd())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29655"), RANK="0",
                      WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    heads, qk_dim, rope_dim, v_dim, s, b = 4, 24, 8, 16, 12, 2
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, kv_channels=8,
                               attention_dropout=0.0, masked_softmax_fusion=False, use_cpu_initialization=True)
    k_channels = qk_dim + rope_dim
    mscale = 0.1 * 0.707 * math.log(40) + 1.0  # yarn's mscale at scaling factor 40, mscale_all_dim 0.707
    scale = mscale * mscale / math.sqrt(k_channels)
    attention = DotProductAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self", softmax_scale=scale, k_channels=k_channels,
                                    v_channels=v_dim)
    torch.manual_seed(0)
    q = torch.randn(s, b, heads, k_channels)
    k = torch.randn(s, b, heads, k_channels)
    kv = torch.randn(s, b, heads, qk_dim + v_dim)
    v = kv[..., qk_dim:]  # a strided view, as MLA splits it
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
    out = attention(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    want = reference(q, k, v, scale)
    err = (out.double() - want).abs().max().item() / want.abs().max().item()
    print(json.dumps({"shape": list(out.shape), "want_shape": list(want.shape), "relative_error": err}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
