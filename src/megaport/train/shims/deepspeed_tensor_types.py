"""``deepspeed-tensor-types``: DeepSpeed's accelerator gives torch.cuda's legacy tensor types again.

DeepSpeed's CUDA accelerator now answers ``FloatTensor``, ``HalfTensor``... with constructors
(``functools.partial``); Megatron-DeepSpeed's Float16Module uses them as types in ``isinstance``,
which fails. They are torch.cuda's legacy tensor types again, as older DeepSpeed gave them.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "deepspeed-tensor-types"
DESCRIPTION = ("DeepSpeed's accelerator gives torch.cuda's legacy tensor types for FloatTensor, HalfTensor... again "
               "(Megatron-DeepSpeed uses them in isinstance)")
ERAS = "Megatron-DeepSpeed with a DeepSpeed whose accelerator returns constructors"
REPRODUCES = "the DeepSpeed versions the fork was written against"
PATTERN = (Match(("TypeError",), message=r"isinstance\(\) arg 2 must be a type"),)
TYPES = ("BFloat16Tensor", "ByteTensor", "DoubleTensor", "FloatTensor", "HalfTensor", "IntTensor", "LongTensor")


def legacy_types(module) -> None:
    import torch

    accelerator = getattr(module, "CUDA_Accelerator", None)
    if accelerator is None:
        return
    for name in TYPES:
        if hasattr(torch.cuda, name) and name in vars(accelerator):
            setattr(accelerator, name, property(lambda self, _name=name: getattr(torch.cuda, _name)))


def install() -> None:
    after_import("deepspeed.accelerator.cuda_accelerator", legacy_types)
