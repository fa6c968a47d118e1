"""``kernel-masked-rows``: upstream's unfused softmax gives a fully masked row the zeros its fused
masked-softmax kernel gives (2022-07-28 on).

Upstream's two softmax paths disagree on a row whose every key is masked: from 76db958327
(2022-07-28) its ``scaled_masked_softmax`` kernel (and apex's and TE's after it) scales such a row
to zeros, while ``forward_torch_softmax`` fills -10000 and normalises it to 1/sk each. The fused
kernel is what upstream runs by default (16-bit inputs); the baseline runs the unfused path only
because the kernel needs CUDA. T5's padded decoder positions are such rows, and they move its loss
(2023-07 tree, fp16, first step: 5.58704 with the kernel's zeros, 5.58974 with the unfused 1/sk,
grad norm 6.861 against 6.914; the port's softmax made to give 1/sk lands on 5.58966 / 6.914). With
this shim the yardstick computes what upstream computes with its fusions on; everything else of
the unfused path stays as it is.
"""

from __future__ import annotations

import functools

from megaport.train.hooks import after_import
from megaport.train.tree_files import tree_text

NAME = "kernel-masked-rows"
DESCRIPTION = ("upstream's unfused softmax gives a fully masked row (16-bit, padding mask) the zeros its fused "
               "masked-softmax kernel gives since 2022-07-28 (it gives 1/sk each): the yardstick computes what "
               "upstream computes with its fusions on")
ERAS = "main 2022-07-28 on (trees whose masked-softmax kernel zeroes such rows)"
REPRODUCES = "upstream's scaled_masked_softmax kernel on fully masked rows (76db958327; apex's and TE's kernels since)"
#: listed up front by the families whose runs have fully masked rows (T5), not asked for by a failure
PATTERN = ()
#: the kernel source in trees that still build it (E1-E3 and Megatron-DeepSpeed); later trees take
#: the kernel from apex or TE, whose kernels zero such rows
_KERNEL_HEADER = ("megatron/fused_kernels/scaled_masked_softmax.h", "megatron/legacy/fused_kernels/scaled_masked_softmax.h")
_ZEROING = "scale_value"  # 76db958327's per-row factor: 0 where the row's maximum is the mask's fill
_SOFTMAX_MODULES = ("megatron.model.fused_softmax", "megatron.core.fusions.fused_softmax",
                    "megatron.legacy.model.fused_softmax")


def applies(tree: str) -> bool:
    """Whether the unported ``tree``'s masked-softmax kernel zeroes fully masked rows: its own
    kernel source says so, or it has none (the kernel then comes from apex or TE)."""
    header = tree_text(tree, *_KERNEL_HEADER)
    return header is None or _ZEROING in header


def zero_fully_masked_rows(module) -> None:
    cls = getattr(module, "FusedScaleMaskSoftmax", None)
    if cls is None or not hasattr(cls, "forward_torch_softmax"):
        return
    unfused = cls.forward_torch_softmax

    @functools.wraps(unfused)
    def forward_torch_softmax(self, input, mask, *args, **kwargs):
        probs = unfused(self, input, mask, *args, **kwargs)
        if mask is None or not getattr(self, "input_in_float16", False):
            return probs  # upstream's fp32 runs this path with its fusions on too
        return probs.masked_fill(mask.bool().all(dim=-1, keepdim=True), 0.0)

    cls.forward_torch_softmax = forward_torch_softmax


def install() -> None:
    for name in _SOFTMAX_MODULES:
        after_import(name, zero_fully_masked_rows)
