"""``fork-deepspeed-train``: Megatron-DeepSpeed's own fixes (636540a9) of its 2023-07 merge, for
``train()`` under ``--deepspeed``.

Its merge of upstream (9e72d571, 2023-07-04) until 636540a9 (2023-07-12) fails under DeepSpeed's
engine; 636540a9's lines, as after-import steps: DeepSpeed's optimizers (ZeRO's, and fp16's without ZeRO) answer ``scale_loss``
None (so ``grad_scale_func`` stays None: the engine scales the loss), ``get_model_config``
unwraps the engine, and ``Timers`` answers ``.timers`` (logging only).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-deepspeed-train"
DESCRIPTION = ("Megatron-DeepSpeed 2023-07-04..2023-07-12 (before 636540a9): that commit's own fixes for train() "
               "with --deepspeed, as after-import steps: DeepSpeed's optimizers answer scale_loss None, "
               "get_model_config unwraps the engine, Timers answers .timers (logging only)")
ERAS = "Megatron-DeepSpeed 9e72d571 … 636540a9^ (2023-07-04 … 2023-07-12)"
REPRODUCES = "Megatron-DeepSpeed 636540a9"
PATTERN = (Match(("AttributeError",), message=r"^'\w*Optimizer\w*' object has no attribute 'scale_loss'"),
           Match(("AttributeError",), message=r"^'dict' object has no attribute 'no_sync_func'"),
           Match(("AttributeError",), message=r"^'Timers' object has no attribute 'timers'"))


def no_scale_loss(module) -> None:
    # every DeepSpeed optimizer: ZeRO's, and fp16's without ZeRO (the fork's MoE example, ZeRO stage 0)
    base = getattr(module, "DeepSpeedOptimizer", None) or getattr(module, "ZeROOptimizer", None)
    if base is not None:
        base.scale_loss = None


def engine_model_config(module) -> None:
    def get_model_config(model):
        from megatron import get_args

        inner = model.module if get_args().deepspeed else model
        return module.get_attr_wrapped_model(inner, "config", allow_none=False)

    module.get_model_config = get_model_config


def timers_by_name(module) -> None:
    module.Timers.timers = property(lambda self: self._timers)


def install() -> None:
    after_import("deepspeed.runtime.base_optimizer", no_scale_loss)
    after_import("megatron.core.utils", engine_model_config)
    after_import("megatron.timers", timers_by_name)
