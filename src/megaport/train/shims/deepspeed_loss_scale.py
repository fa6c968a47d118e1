"""``deepspeed-loss-scale``: DeepSpeed's fp16 optimizers answer ``cur_scale`` again.

DeepSpeed's fp16 optimizers without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) moved
their loss scale into a ``loss_scale_config``; Megatron-DeepSpeed before its own 3ed9f4f7
(2023-05) reads ``optimizer.cur_scale`` for its log line and formats what it finds, None there, which
raises. ``cur_scale`` is a property of the scale again, as the DeepSpeed the fork was written
against kept it.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "deepspeed-loss-scale"
DESCRIPTION = ("DeepSpeed's fp16 optimizers without ZeRO answer cur_scale (their loss scale) again "
               "(Megatron-DeepSpeed before 3ed9f4f7 formats it into its log line)")
ERAS = "Megatron-DeepSpeed before 2023-05 (3ed9f4f7) with ZeRO stage 0 in fp16"
REPRODUCES = "the DeepSpeed versions the fork was written against"
PATTERN = (Match(("TypeError",), message=r"unsupported format string passed to NoneType\.__format__",
                 code=r"loss scale"),)
MODULES = ("deepspeed.runtime.fp16.fused_optimizer", "deepspeed.runtime.fp16.unfused_optimizer")


def scale_again(module) -> None:
    if not hasattr(module, "LossScaleConfig"):  # a DeepSpeed whose optimizers keep cur_scale themselves
        return
    for name in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        optimizer = getattr(module, name, None)
        if optimizer is None or "cur_scale" in vars(optimizer):
            continue

        def get(self):
            return self.loss_scale_config.cur_scale

        def put(self, value):
            self.loss_scale_config.cur_scale = value

        optimizer.cur_scale = property(get, put)


def install() -> None:
    for module in MODULES:
        after_import(module, scale_again)
