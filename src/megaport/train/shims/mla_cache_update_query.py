"""``mla-cache-update-query``: MultiLatentAttention's call of the KV-cache update works with the base class's new signature, as upstream's 369fec6c7c.

From 2e047cff8a (2024-10-29, flash decoding) ``Attention._adjust_key_value_for_inference`` took
``(inference_params, query, key, value, rotary_pos_emb, ...)`` and returned the query too, while
``MultiLatentAttention.forward`` still called it ``(inference_params, key, value,
rotary_pos_emb=None)`` and unpacked four values, until 369fec6c7c reached main (bc8c4f3562,
2024-11-07): every MLA model (DeepSeek) stopped at its first step with ``TypeError:
Attention._adjust_key_value_for_inference() missing 1 required positional argument: 'value'``, on
any machine. Here MLA gets a method of its own that takes the old call, hands the base class no
query, and returns what the old call unpacks; in training (no inference parameters) the base class
returns its inputs as they came. The port fixes the same window in its own way, upstream's call
itself (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "mla-cache-update-query"
DESCRIPTION = ("main 2024-10-29 … 11-07: MLA called the attention base class's KV-cache update without the query "
               "its new signature asks for (TypeError, DeepSeek trained nothing); MLA's own method takes the old "
               "call, as upstream's 369fec6c7c makes it work")
ERAS = "main 2024-10-29 (2e047cff8a) … 2024-11-07 (bc8c4f3562)"
REPRODUCES = "upstream's 369fec6c7c (Fix signature for multi-latent attention KV cache update)"
PATTERN = (Match(("TypeError",), message=r"_adjust_key_value_for_inference\(\) missing 1 required positional "
                                         r"argument: 'value'"),)


def old_call_taken(module) -> None:
    base = module.Attention._adjust_key_value_for_inference

    def adjust_without_query(self, inference_params, key, value, rotary_pos_emb=None):
        _, key, value, rotary_pos_emb, mask_type = base(self, inference_params, None, key, value, rotary_pos_emb)
        return key, value, rotary_pos_emb, mask_type

    module.MultiLatentAttention._adjust_key_value_for_inference = adjust_without_query


def install() -> None:
    after_import("megatron.core.transformer.multi_latent_attention", old_call_taken)
