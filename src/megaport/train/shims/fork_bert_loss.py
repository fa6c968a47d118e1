"""``fork-bert-loss``: Megatron-DeepSpeed's BertModel returns its two outputs without ``return_moe_loss``.

From 319c9b1c (2023-08-09) BertModel ends ``return *lm_output, moe_losses if self.return_moe_loss
else lm_output``: the conditional is only the tuple's last element, so the model returns
``(lm_loss, sop_logits, (lm_loss, sop_logits))`` on every run and pretrain_bert.py's loss_func,
which unpacks two values until the fork's a9856ce0 (2024-02-28), fails on it. That tuple becomes
the two outputs, as the flag, off by default, means.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-bert-loss"
DESCRIPTION = ("Megatron-DeepSpeed 319c9b1c..a9856ce0^ (2023-08-09..2024-02-27): BertModel returns (lm_loss, "
               "sop_logits, (lm_loss, sop_logits)) without return_moe_loss (its conditional return binds to the "
               "tuple's last element), which pretrain_bert.py's loss_func cannot unpack: the two outputs, as "
               "return_moe_loss off means")
ERAS = "Megatron-DeepSpeed 319c9b1c … a9856ce0^ (2023-08-09 … 2024-02-27)"
REPRODUCES = "the parenthesised return 319c9b1c meant (the fork's a9856ce0 unpacks three values instead)"
PATTERN = (Match(("ValueError",), message=r"^too many values to unpack \(expected 2\)",
                 code=r"lm_loss_, sop_logits = output_tensor$"),)


def two_outputs(module) -> None:
    forward = module.BertModel.forward

    def forward_returning_two(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        # (lm_loss, sop_logits, (lm_loss, sop_logits)): the tuple the unparenthesised conditional builds
        if (not getattr(self, "return_moe_loss", True) and isinstance(output, tuple) and len(output) == 3
                and isinstance(output[2], tuple) and output[2] and output[2][0] is output[0]):
            return output[2]
        return output

    module.BertModel.forward = forward_returning_two


def install() -> None:
    after_import("megatron.model.bert_model", two_outputs)
