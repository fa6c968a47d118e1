"""``fork-t5-moe-losses``: Megatron-DeepSpeed's T5Model gets its language model's two outputs.

From 50b32515 (MoE support) the fork's language model returns one MoE loss per layer after
``decoder_output, encoder_output``, which T5Model unpacks as two until 712057c8: every T5 run
fails on its first forward. A language model with a decoder that T5Model builds answers the two
and drops the losses, which T5's loss never reads, as 712057c8 drops them.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match
from megaport.train.shims._serve import language_models_through

NAME = "fork-t5-moe-losses"
DESCRIPTION = ("Megatron-DeepSpeed 2022-06-07..2023-08-08 (50b32515 to before 712057c8): T5Model unpacks its "
               "language model's output as (decoder_output, encoder_output), which carries one MoE loss per layer "
               "after them: the language model T5Model builds answers the two, as 712057c8 takes them")
ERAS = "Megatron-DeepSpeed 50b32515 … 712057c8^ (2022-06-07 … 2023-08-08)"
REPRODUCES = "Megatron-DeepSpeed 712057c8 (T5Model leaves the MoE losses)"
PATTERN = (Match(("ValueError",), message=r"^too many values to unpack",
                 code=r"decoder_output, encoder_output = lm_output$"),)


def without_moe_losses(language_model):
    """``language_model`` whose forward answers (decoder_output, encoder_output) where it has a decoder."""
    forward = language_model.forward

    def decoder_and_encoder_outputs(*args, **kwargs):
        return forward(*args, **kwargs)[:2]

    if language_model.add_decoder:
        language_model.forward = decoder_and_encoder_outputs
    return language_model


def t5_language_model_without_moe_losses(module) -> None:
    language_models_through(module, without_moe_losses)


def install() -> None:
    after_import("megatron.model.t5_model", t5_language_model_without_moe_losses)
