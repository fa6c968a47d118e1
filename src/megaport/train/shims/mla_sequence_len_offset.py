"""``mla-sequence-len-offset``: MultiLatentAttention takes TransformerLayer's ``sequence_len_offset``, as upstream's b5836f82f6.

From 8fba594837 (2025-01-09, inference CUDA graphs) ``TransformerLayer`` passed
``sequence_len_offset`` to its self-attention; ``Attention.forward`` took it,
``MultiLatentAttention.forward`` did not until b5836f82f6 (2025-02-10, "MLA_Fix"), so every MLA
model (DeepSeek) stopped at its first step with ``TypeError: MultiLatentAttention.forward() got an
unexpected keyword argument 'sequence_len_offset'``, on any machine. Here the class's forward is
given the keyword and drops it, as upstream's fix leaves it unused in training. The port fixes the
same window in its own way (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "mla-sequence-len-offset"
DESCRIPTION = ("main 2025-01-09 … 02-10: TransformerLayer passed sequence_len_offset to MLA, whose forward did not take "
               "it (TypeError, DeepSeek trained nothing); the keyword taken and unused, as upstream's b5836f82f6")
ERAS = "main 2025-01-09 (8fba594837) … 2025-02-10 (b5836f82f6)"
REPRODUCES = "upstream's b5836f82f6 (MLA_Fix)"
PATTERN = (Match(("TypeError",), message=r"MultiLatentAttention\.forward\(\) got an unexpected keyword argument "
                                         r"'sequence_len_offset'"),)


def offset_taken(module) -> None:
    cls = module.MultiLatentAttention
    forward = cls.forward

    def forward_with_offset(self, *args, sequence_len_offset=None, **kwargs):
        return forward(self, *args, **kwargs)

    cls.forward = forward_with_offset


def install() -> None:
    after_import("megatron.core.transformer.multi_latent_attention", offset_taken)
