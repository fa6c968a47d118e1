"""What the smoke suite does differently for a Megatron-DeepSpeed tree.

The fork's megatron/core reads Megatron's global args where upstream's takes a config: its
tensor-parallel layers' backward (``args.enable_zbh1_pipeline``), for one. A check that builds
those layers outside ``pretrain_gpt.py`` first sets the args to the fork's own parser defaults, as
``initialize_megatron`` with no flags would (with ``params_dtype``, which its validation derives).
"""

from __future__ import annotations

import sys
from pathlib import Path


def set_default_args(tree) -> bool:
    """Set the fork's global args to its parser's defaults if a fork tree has none yet; True if set."""
    from megaport.deepspeed_fork import is_deepspeed_tree

    if not is_deepspeed_tree(tree) or not (Path(tree) / "megatron/core").is_dir():
        return False  # the 2021-2022 fork has megatron/mpu, which takes args like upstream's of its time
    from megatron import global_vars

    if getattr(global_vars, "_GLOBAL_ARGS", None) is not None:
        return False
    from megatron.arguments import parse_args

    argv, sys.argv = sys.argv, [sys.argv[0]]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    # What validate_args derives from the defaults that the layers read (it needs a world to run).
    import torch

    args.params_dtype = torch.float32  # neither --fp16 nor --bf16
    global_vars._GLOBAL_ARGS = args
    return True


def fuses_wgrad(layers) -> bool:
    """Whether the module ``layers``' tensor-parallel linear backward calls the wgrad accumulation
    GEMM at all (:func:`fuses_wgrad_source` of its source; True when it has none)."""
    import inspect

    try:
        source = inspect.getsource(layers)
    except (OSError, TypeError):
        return True
    return fuses_wgrad_source(source)


def fuses_wgrad_source(source: str) -> bool:
    """Whether tensor-parallel layers' source calls the wgrad accumulation GEMM at all (a line that
    is not a comment). The DeepSpeed fork commented it out at its 2023-07 merge, so there
    --gradient-accumulation-fusion does nothing."""
    return any("wgrad_gemm_accum" in line and not line.lstrip().startswith("#") for line in source.splitlines())


def era_fuses_wgrad(upstream, tree) -> tuple[bool, str | None]:
    """Whether the era's tensor-parallel backward fuses the wgrad GEMM, asked of the unported
    upstream commit's layers (megatron/core/tensor_parallel/layers.py, else megatron/mpu/layers.py,
    as the 2-rank run imports them), so that a patch that removed the call fails the check rather
    than switch it to the fork's "never fuses" expectations. Where upstream cannot be read the
    ported tree answers, and a "never" from it comes with the note that ``verify --strict``
    counts; ``(fuses, note or None)``."""
    from megaport.smoke._locate import TP_LAYERS

    if upstream is not None and upstream.available:
        for path in TP_LAYERS:
            text = upstream.read(path)
            if text is not None:
                return fuses_wgrad_source(text), None
        return True, None
    for path in TP_LAYERS:
        try:
            text = (Path(tree) / path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        fused = fuses_wgrad_source(text)
        why = upstream.why if upstream is not None else "no upstream commit"
        return fused, None if fused else f"{path} never fuses the wgrad GEMM, from the ported tree ({why})"
    return True, None
