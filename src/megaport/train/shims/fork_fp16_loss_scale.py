"""``fork-fp16-loss-scale``: Megatron-DeepSpeed's train() scales the loss on the model's config.

From its merge of upstream (9e72d571, 2023-07-04) the fork's train() sets ``grad_scale_func`` on a
config it builds afresh, while the schedules read the model's own: without ``--deepspeed`` an fp16
run backpropagates its loss unscaled and the optimizer still unscales the gradients (1/scale of
their value; grad norm 0.001 for 5.5). Upstream fixed it in 0b14cc27cc after the fork's merge.
Nothing fails, so the families whose runs take Megatron's own loop (BERT, T5) list it up front;
it applies to the fork's trees that have those lines, whose series carry the same fix.
"""

from __future__ import annotations

import re

from megaport.train.hooks import after_import
from megaport.train.tree_files import tree_text

NAME = "fork-fp16-loss-scale"
DESCRIPTION = ("Megatron-DeepSpeed from 9e72d571 (2023-07-04): train() sets grad_scale_func on a config it builds "
               "afresh, not on the model's the schedules read, so fp16 without --deepspeed backpropagates the loss "
               "unscaled and unscales the gradients all the same: the model's config gets it too, as upstream's "
               "0b14cc27cc sets it")
ERAS = "Megatron-DeepSpeed 9e72d571 on (2023-07-04 …)"
REPRODUCES = "upstream's 0b14cc27cc (grad_scale_func on the model's config)"
#: listed up front by the families whose fork runs take Megatron's own loop, not asked for by a failure
PATTERN = ()
_FRESH_CONFIG = re.compile(r"config = core_transformer_config_from_args\(args\)\n(\s*if not args\.deepspeed:\n)?"
                           r"\s*config\.grad_scale_func = optimizer\.scale_loss\n")


def applies(tree: str) -> bool:
    """Whether the unported ``tree`` is the fork's and its train() scales the loss on a fresh config."""
    from megaport.deepspeed_fork import is_deepspeed_tree

    return is_deepspeed_tree(tree) and _FRESH_CONFIG.search(tree_text(tree, "megatron/training.py") or "") is not None


def loss_scale_on_the_models_config(module) -> None:
    train = module.train

    def train_scaling_the_loss(forward_step_func, model, optimizer, *args, **kwargs):
        from megatron import get_args
        from megatron.core.utils import get_model_config

        if not get_args().deepspeed:
            get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
        return train(forward_step_func, model, optimizer, *args, **kwargs)

    module.train = train_scaling_the_loss


def install() -> None:
    after_import("megatron.training", loss_scale_on_the_models_config)
