"""``fork-attention-view``: Megatron-DeepSpeed's CoreAttention gets contiguous query, key and value.

From 676a482c the fork's CoreAttention views the strided slices of its QKV split, which fails on
every device; the same values, in a layout its views accept.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-attention-view"
DESCRIPTION = ("Megatron-DeepSpeed from 676a482c: CoreAttention gets contiguous query/key/value (its views fail on "
               "the strided slices of its QKV split on every device; the same values)")
ERAS = "Megatron-DeepSpeed 2024-12 on (676a482c)"
REPRODUCES = "the .contiguous() the fork's own view needs"
PATTERN = (Match(("RuntimeError",), message=r"view size is not compatible", code=r"(query|key|value)_layer = \w+\.view\("),)


def contiguous_core_attention(module) -> None:
    forward = module.CoreAttention.forward

    def contiguous_forward(self, query_layer, key_layer, value_layer, *args, **kwargs):
        return forward(self, query_layer.contiguous(), key_layer.contiguous(), value_layer.contiguous(),
                       *args, **kwargs)

    module.CoreAttention.forward = contiguous_forward


def install() -> None:
    after_import("megatron.model.transformer", contiguous_core_attention)
