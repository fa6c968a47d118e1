"""``fork-t5-loss``: Megatron-DeepSpeed's T5Model returns its loss alone without ``return_moe_loss``.

From 62791cc6 T5Model ends ``return lm_loss, dec_moe_losses, enc_moe_losses if self.return_moe_loss
else lm_loss``: the conditional is only the tuple's last element, so the model returns
``(lm_loss, dec_moe_losses, lm_loss)`` on every run and pretrain_t5.py's loss_func fails on it.
That tuple becomes the loss alone, as the flag, off by default, means.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-t5-loss"
DESCRIPTION = ("Megatron-DeepSpeed from 62791cc6 (2023-08-11): T5Model returns (lm_loss, dec_moe_losses, lm_loss) "
               "without return_moe_loss (its conditional return binds to the tuple's last element), which "
               "pretrain_t5.py's loss_func cannot take: the loss alone, as return_moe_loss off means")
ERAS = "Megatron-DeepSpeed 62791cc6 on (2023-08-11 …)"
REPRODUCES = "the parenthesised return 62791cc6 meant"
PATTERN = (Match(("AttributeError",), message=r"^'tuple' object has no attribute 'float'",
                 code=r"= output_tensor\.float\(\)$"),)


def loss_alone(module) -> None:
    forward = module.T5Model.forward

    def forward_returning_the_loss(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        # (lm_loss, dec_moe_losses, lm_loss): the tuple the unparenthesised conditional builds
        if not self.return_moe_loss and isinstance(output, tuple) and len(output) == 3 and output[2] is output[0]:
            return output[0]
        return output

    module.T5Model.forward = forward_returning_the_loss


def install() -> None:
    after_import("megatron.model.t5_model", loss_alone)
