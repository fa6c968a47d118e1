"""``mla-rotary-pos-cos-sin``: MultiLatentAttention takes TransformerLayer's ``rotary_pos_cos`` and ``rotary_pos_sin``, as upstream's 60d5b383fa.

From 2e047cff8a (2024-10-29, flash decoding) ``TransformerLayer`` passed ``rotary_pos_cos`` and
``rotary_pos_sin`` to its self-attention; ``Attention.forward`` took them,
``MultiLatentAttention.forward`` did not until 60d5b383fa (2024-12-07), so every MLA model
(DeepSeek) stopped at its first step with ``TypeError: MultiLatentAttention.forward() got an
unexpected keyword argument 'rotary_pos_cos'``, on any machine. Here the class's forward is given
both keywords and, as upstream's fix asserts, refuses a value (MLA has no flash decoding); in
training both are None. The port fixes the same window in its own way (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "mla-rotary-pos-cos-sin"
DESCRIPTION = ("main 2024-10-29 … 12-07: TransformerLayer passed flash decoding's rotary_pos_cos/sin to MLA, whose "
               "forward did not take them (TypeError, DeepSeek trained nothing); the keywords taken, None required, "
               "as upstream's 60d5b383fa")
ERAS = "main 2024-10-29 (2e047cff8a) … 2024-12-07 (60d5b383fa)"
REPRODUCES = "upstream's 60d5b383fa (MLA's forward takes rotary_pos_cos/sin, asserting them None)"
PATTERN = (Match(("TypeError",), message=r"MultiLatentAttention\.forward\(\) got an unexpected keyword argument "
                                         r"'rotary_pos_(cos|sin)'"),)


def cos_sin_taken(module) -> None:
    cls = module.MultiLatentAttention
    forward = cls.forward

    def forward_with_cos_sin(self, *args, rotary_pos_cos=None, rotary_pos_sin=None, **kwargs):
        assert rotary_pos_cos is None and rotary_pos_sin is None, "MLA does not support Flash Decoding"
        return forward(self, *args, **kwargs)

    cls.forward = forward_with_cos_sin


def install() -> None:
    after_import("megatron.core.transformer.multi_latent_attention", cos_sin_taken)
