"""``fork-bert-moe-losses``: Megatron-DeepSpeed's BertModel gets its language model's outputs
without the MoE losses.

From 50b32515 (MoE support) the fork's language model returns one MoE loss per layer after
``encoder_output, pooled_output``, which BertModel unpacks as two until 712057c8: every BERT run
fails on its first forward. The language model BertModel builds answers the two (the encoder
output alone without the pooler) and drops the losses, which BERT's loss never reads, as
712057c8 drops them.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match
from megaport.train.shims._serve import language_models_through

NAME = "fork-bert-moe-losses"
DESCRIPTION = ("Megatron-DeepSpeed 2022-06-07..2023-08-08 (50b32515 to before 712057c8): BertModel unpacks its "
               "language model's output as (encoder_output, pooled_output), which carries one MoE loss per layer "
               "after them: the language model BertModel builds answers without them, as 712057c8 takes them")
ERAS = "Megatron-DeepSpeed 50b32515 … 712057c8^ (2022-06-07 … 2023-08-08)"
REPRODUCES = "Megatron-DeepSpeed 712057c8 (BertModel leaves the MoE losses)"
PATTERN = (Match(("ValueError",), message=r"^too many values to unpack",
                 code=r"lm_output, pooled_output = lm_output$"),)


def without_moe_losses(language_model):
    """``language_model`` whose forward answers (encoder_output, pooled_output) with a pooler, else
    the encoder output alone."""
    forward = language_model.forward

    def outputs_without_moe_losses(*args, **kwargs):
        outputs = forward(*args, **kwargs)
        if not isinstance(outputs, tuple):
            return outputs
        return outputs[:2] if language_model.add_pooler else outputs[0]

    language_model.forward = outputs_without_moe_losses
    return language_model


def bert_language_model_without_moe_losses(module) -> None:
    language_models_through(module, without_moe_losses)


def install() -> None:
    after_import("megatron.model.bert_model", bert_language_model_without_moe_losses)
