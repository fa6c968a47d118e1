"""``fork-save-destination``: Megatron-DeepSpeed's models take DeepSpeed's ``destination`` when it saves, as the fork's c11fda71.

From the fork's merge of upstream main (9e72d571, 2023-07-04) until c11fda71 (2023-07-11) its
``save_checkpoint`` pointed the model's ``state_dict`` at ``state_dict_for_save_checkpoint``, which
took no ``destination`` any more, and DeepSpeed's engine passes one: no checkpoint was written. Here,
for the length of each save, the model answers with a method that takes and drops it; the port fixes
the same window in its own way (``rocm_port.fork_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-save-destination"
DESCRIPTION = ("Megatron-DeepSpeed 2023-07-04 … 07-11: the model's checkpoint state dict takes the destination "
               "DeepSpeed's engine passes, as the fork's c11fda71 (no checkpoint was written)")
ERAS = "Megatron-DeepSpeed 9e72d571 (2023-07-04) … c11fda71 (2023-07-11)"
REPRODUCES = "the fork's c11fda71 (fix checkpoint saving)"
PATTERN = (Match(("TypeError",), message=r"state_dict_for_save_checkpoint\(\) got an unexpected keyword argument "
                                         r"'destination'"),)


def destination_taken(module) -> None:
    save = module.save_checkpoint

    def save_checkpoint(iteration, model, *args, **kwargs):
        inner = getattr(model[0], "module", None)
        method = getattr(type(inner), "state_dict_for_save_checkpoint", None)
        if method is not None:
            inner.state_dict_for_save_checkpoint = (
                lambda destination=None, prefix="", keep_vars=False: method(inner, prefix=prefix, keep_vars=keep_vars))
        try:
            return save(iteration, model, *args, **kwargs)
        finally:
            if method is not None:
                del inner.state_dict_for_save_checkpoint

    module.save_checkpoint = save_checkpoint


def install() -> None:
    after_import("megatron.checkpointing", destination_taken)
