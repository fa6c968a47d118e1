"""The registry of baseline shims: which exist, which answers a failure, and how a baseline
process gets them (see the package's docstring for what a shim is)."""

from __future__ import annotations

import os
from pathlib import Path

from megaport.train.shims import (apex_pytorch, bert_te_spec, chained_clip_total_norm, cpu_init_rank_name, dcp_write_item, deprecated_decorator_import, deepspeed_compression, deepspeed_loss_scale, dp_reshardable_no_grad,
                                  deepspeed_tensor_types, empty_rank_groups, fork_attention_view, fork_bert_loss, fork_bert_moe_losses, fork_deepspeed_train, fork_load_only_weights, fork_pipe_transposes, fork_save_destination,
                                  fork_fp16_loss_scale, fork_train_step, fp8_shard_without_te, fork_legacy_mpu, fork_t5_loss, fork_t5_moe_losses,
                                  fused_kernel_build, grouped_gemm_loop, kernel_masked_rows, layer_count_mpu, mla_attention,
                                  mla_cache_update_query, mla_cp_comm_type, mla_rotary_cos_sin, mla_sequence_len_offset,
                                  moe_spec_use_te,
                                  overlap_gather_save, save_plan_iobytes_once, selective_recompute_method, stack_names,
                                  t5_decoder_output_pads, te_cross_entropy_import, te_projector_import,
                                  te_import_stub, te_norm, te_spec, torch_load_trusting, transformers_sentinels,
                                  wgrad_contiguous)

#: Every shim, in the order a failure is offered to them (the first whose pattern matches answers).
REGISTRY = {shim.NAME: shim for shim in (
    te_cross_entropy_import, te_projector_import, deprecated_decorator_import, te_import_stub, stack_names, apex_pytorch, fused_kernel_build, te_norm, te_spec, bert_te_spec,
    deepspeed_compression, wgrad_contiguous, fork_attention_view, deepspeed_tensor_types, fork_deepspeed_train, fork_legacy_mpu,
    deepspeed_loss_scale, fork_t5_moe_losses, fork_bert_moe_losses, fork_t5_loss, grouped_gemm_loop, mla_attention,
    mla_cp_comm_type, mla_cache_update_query, mla_rotary_cos_sin, mla_sequence_len_offset, kernel_masked_rows,
    fork_fp16_loss_scale, transformers_sentinels, fp8_shard_without_te,
    fork_train_step, fork_bert_loss, torch_load_trusting, empty_rank_groups, chained_clip_total_norm,
    t5_decoder_output_pads, dp_reshardable_no_grad, overlap_gather_save, dcp_write_item, save_plan_iobytes_once,
    moe_spec_use_te, cpu_init_rank_name, layer_count_mpu, fork_pipe_transposes, fork_save_destination,
    selective_recompute_method, fork_load_only_weights)}
SHIMS_ENV = "MEGAPORT_BASELINE_SHIMS"
_STARTUP = Path(__file__).with_name("startup")


def describe(name: str) -> str:
    return REGISTRY[name].DESCRIPTION


def applies(name: str, tree: str) -> bool:
    """Whether shim ``name`` has anything to do in the unported ``tree`` (its ``applies`` rule; a
    shim without one always has): a family's up-front shims are installed, and listed, only there."""
    rule = getattr(REGISTRY[name], "applies", None)
    return rule is None or rule(tree)


def pick(failures, have) -> str | None:
    """The shim that answers one of ``failures`` (the first in registry order), never one in ``have``."""
    for name, shim in REGISTRY.items():
        if name not in have and any(m.matches(f) for f in failures for m in shim.PATTERN):
            return name
    return None


def environment(env: dict, names: list) -> dict:
    """``env`` for a baseline process with ``names`` installed at start-up (by this package's
    ``sitecustomize``, first on PYTHONPATH); with no names, only the audit of port code."""
    from megaport.envpaths import with_paths_first

    return {**with_paths_first(env, _STARTUP), SHIMS_ENV: ",".join(names)}


def install_from_environment() -> list:
    """In a baseline process: install the shims ``$MEGAPORT_BASELINE_SHIMS`` names, in order."""
    names = [n for n in os.environ.get(SHIMS_ENV, "").split(",") if n]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise RuntimeError(f"{SHIMS_ENV} names unknown baseline shims {unknown}; known: {sorted(REGISTRY)}")
    for name in names:
        REGISTRY[name].install()
    return names
