"""``fp8-shard-without-te``: upstream's distributed optimizer steps without TransformerEngine.

From 062c833392 (2025-04-02) the distributed optimizer hands ``fp8_utils.quantize_param_shard``
the model's FP8 parameters after every step, and without TE that function's fallback raises
"Invalid Transformer Engine version for FP8 distributed optimizer" whatever it is given, an empty
list included: no ``--use-distributed-optimizer`` run trains without TE until upstream's own
76203e757e (2025-07-15, "Fix error when TE is not installed") lets an empty list through. This
shim is that fix.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fp8-shard-without-te"
DESCRIPTION = ("upstream's fp8_utils.quantize_param_shard returns when there is no FP8 parameter to quantize, "
               "as its 76203e757e has it (without TE its fallback raised on every distributed-optimizer step)")
ERAS = "upstream 062c833392 … 76203e757e^ (2025-04-02 … 2025-07-15), --use-distributed-optimizer without TE"
REPRODUCES = "upstream 76203e757e (Fix error when TE is not installed)"
PATTERN = (Match(("RuntimeError",), message=r"^Invalid Transformer Engine version for FP8 distributed optimizer",
                 file=r"fp8_utils\.py$"),)


def empty_shard_list_passes(module) -> None:
    """The fallback lets an empty list through, as 76203e757e. Whatever ``HAVE_TE`` says: where the
    baseline also needs the TE import stub (core 0.12.3 asks TE's version when it loads a
    checkpoint), ``HAVE_TE`` is True, the stub's version takes no TE branch, and the fallback still
    raises (layout comparisons of core_v0.12.3: unported dp2-distopt and ep2 died of it)."""
    fallback = module.__dict__.get("_quantize_param_shard_impl")
    if fallback is None:
        return

    def quantize_nothing_or_fail(model_params, *args, **kwargs):
        if not model_params:
            return
        fallback(model_params, *args, **kwargs)

    module._quantize_param_shard_impl = quantize_nothing_or_fail


def install() -> None:
    after_import("megatron.core.fp8_utils", empty_shard_list_passes)
