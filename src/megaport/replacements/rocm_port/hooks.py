"""What importing the port changes in the process: the finders it installs and the tables of steps
they run around upstream modules as those load. The tables and the finders live here once, for
every module of the package."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from . import te_absent
from .attention import _sdpa_in_dot_product_attention, _sdpa_in_legacy_core_attention
from .blocker import install_import_blocker
from .checkpoint_keys import _checkpoints_read_either_spelling
from .era import TRANSFORMER_ENGINE_IMPORTS_GUARDED
from .optimizer_state import (
    _checkpoint_step_per_parameter,
    _model_space_state_without_step,
    _param_state_without_step,
    _step_before_the_first_step,
    _torch_adams_step_in_param_groups,
)
from .target_stack import (
    _async_writer_calls_todays_write_item,
    _both_resize_names,
    _checkpoints_load_as_they_were_saved,
    _iobytes_requested_once,
    _save_planner_takes_coordinator_by_name,
    _sentinel_tokens_kept,
    _zero_takes_port_fused_adam,
    fp16_optimizers_answer_cur_scale,
    install_target_stack_compat,
    legacy_tensor_types,
    serve_removed_deepspeed_compression,
)
from .te_absent import (
    _GPT_SPECS_MODULE,
    _TransformerEngineLayersStandIn,
    _bert_masks_for_local_layers,
    _legacy_transformer_builds_local_layers,
    _port_multi_tensor_helpers,
    _rope_fusion_off_before_checks,
    _serve_te_layer_specs,
    _t5_masks_for_local_layers,
    _te_layer_names_declared,
)
from .upstream_fixes import (
    _arguments_validate_twice,
    _chained_optimizers_clip_by_one_norm,
    _cpu_init_names_its_rank,
    _dispatcher_sorts_by_viewed_counts,
    _layer_count_asks_mpu,
    _local_moe_spec_takes_use_te,
    _mla_hands_its_query_to_the_cache_update,
    _mla_takes_the_layers_keywords,
    _no_group_of_no_ranks,
    _norm_without_the_removed_flag,
    _rank_logged_without_a_group,
    _selective_recompute_takes_no_method,
    _t5_decoder_output_pads_zeroed,
    _tied_weights_grad_hook,
    _tied_weights_keep_both_gradients,
    _tied_wgrad_placeholder_zeroed,
    _weights_gathered_before_save,
    _SOURCE_FIXES,
    _fixed_module_code,
)
from .fork_fixes import (
    _deepspeed_save_takes_destination,
    _load_takes_load_only_weights,
    _model_takes_the_pipes_patterns,
    _pipe_transposes_once,
    _sequence_parallel_grads_summed_under_deepspeed,
)
from .te_features import (
    _TE_NONE_NAMES,
    _TE_NORM_USERS,
    _fp8_off_before_validation,
    _mla_duplicated_down_projections,
    _mla_has_no_te,
    _mla_query_norm_as_te_spec,
    _no_fp8_params_to_fix_without_te,
    _no_fp8_shard_to_quantize_without_te,
    _say_grouped_gemm_runs_sequential,
    _serve_grouped_gemm,
    _serve_mla_channels,
    _serve_rms_norm_in_fused_layer_norm,
    _serve_zero_centered_gamma_in_torch_norm,
    _te_backend_is_local,
    _te_helpers_none,
    _te_norm_is_the_port_norm,
)

def _steps(entry) -> tuple:
    """A table entry as a tuple of steps: one function, or several in the order they run."""
    return () if entry is None else tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


# What old upstream code needs of today's torch, NumPy and transformers right after a module loads.
_AFTER_IMPORT_TARGET_STACK = {
    "megatron.model.vision.utils": _both_resize_names,
    "megatron.model.vision.inpainting": _both_resize_names,
    "megatron.core.tokenizers.text.libraries.huggingface_tokenizer": _sentinel_tokens_kept,
    "megatron.core.dist_checkpointing.strategies.torch": (_save_planner_takes_coordinator_by_name,
                                                          _iobytes_requested_once,
                                                          _checkpoints_load_as_they_were_saved),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": _async_writer_calls_todays_write_item,
    **{name: _checkpoints_load_as_they_were_saved for name in (
        "megatron.core.dist_checkpointing.serialization", "megatron.core.dist_checkpointing.strategies.common",
        "megatron.training.checkpointing",
        "megatron.checkpointing")},
}

# Upstream's own bugs in a window of its history, fixed on every machine, ported or not (.upstream_fixes).
_AFTER_IMPORT_UPSTREAM_FIXES = {
    "megatron.core.parallel_state": _no_group_of_no_ranks,
    "megatron.training.arguments": _arguments_validate_twice,
    "megatron.training.checkpointing": (_rank_logged_without_a_group, _weights_gathered_before_save),
    # the fork's save first: it recompiles save_checkpoint, which the gather then wraps
    "megatron.checkpointing": (_deepspeed_save_takes_destination, _load_takes_load_only_weights,  # name until 2024-03-26
                               _weights_gathered_before_save),
    "megatron.core.transformer.transformer_config": _selective_recompute_takes_no_method,
    "megatron.legacy.model.utils": _norm_without_the_removed_flag,
    "megatron.core.optimizer.optimizer": _chained_optimizers_clip_by_one_norm,
    "megatron.optimizer.optimizer": _chained_optimizers_clip_by_one_norm,  # its name until 2024-02-13
    "megatron.core.datasets.t5_dataset": _t5_decoder_output_pads_zeroed,
    "megatron.core.models.gpt.gpt_layer_specs": _local_moe_spec_takes_use_te,
    "megatron.core.tensor_parallel.layers": _tied_wgrad_placeholder_zeroed,
    "megatron.core.distributed.distributed_data_parallel": _tied_weights_grad_hook,
    "megatron.core.models.common.language_module.language_module": _tied_weights_keep_both_gradients,
    "megatron.model.module": _tied_weights_keep_both_gradients,
    "megatron.mpu.layers": _cpu_init_names_its_rank,
    "megatron.model.transformer": _layer_count_asks_mpu,
    "megatron.core.transformer.multi_latent_attention": (_mla_hands_its_query_to_the_cache_update,  # first: recompiles forward
                                                          _mla_takes_the_layers_keywords),
    "megatron.core.transformer.moe.token_dispatcher": _dispatcher_sorts_by_viewed_counts,
    # Megatron-DeepSpeed's own (.fork_fixes)
    "megatron.training": _sequence_parallel_grads_summed_under_deepspeed,
    "megatron.model.gpt_model": (_pipe_transposes_once, _model_takes_the_pipes_patterns),
}

# What Megatron-DeepSpeed's code needs of today's DeepSpeed right after a module loads.
_AFTER_IMPORT_DEEPSPEED = {
    "deepspeed.runtime.zero.utils": _zero_takes_port_fused_adam,
    "deepspeed.accelerator.cuda_accelerator": legacy_tensor_types,
    "deepspeed.runtime.fp16.fused_optimizer": fp16_optimizers_answer_cur_scale,
    "deepspeed.runtime.fp16.unfused_optimizer": fp16_optimizers_answer_cur_scale,
}

# Where the port routes core attention through SDPA, whatever is installed.
_AFTER_IMPORT_ATTENTION = {
    "megatron.core.transformer.dot_product_attention": _sdpa_in_dot_product_attention,
    "megatron.core.transformer.core_attention": _sdpa_in_legacy_core_attention,  # its name 2023-06-29 … 07-24
    "megatron.legacy.model.transformer": _sdpa_in_legacy_core_attention,
    "megatron.model.transformer": _sdpa_in_legacy_core_attention,
}

# What the port serves in an upstream module right after it loads, when TransformerEngine is absent.
_AFTER_IMPORT_WITHOUT_TE = {
    "megatron.core.fp8_utils": _no_fp8_shard_to_quantize_without_te,
    # the local layers built in TE's place read a checkpoint written with TE's key spellings too
    "megatron.core.dist_checkpointing.serialization": _checkpoints_read_either_spelling,
    "megatron.core.optimizer.distrib_optimizer": (_step_before_the_first_step, _checkpoint_step_per_parameter,
                                                    _param_state_without_step, _model_space_state_without_step),
    "megatron.core.transformer.transformer_config": _rope_fusion_off_before_checks,
    "megatron.core.optimizer.clip_grads": _port_multi_tensor_helpers,
    "megatron.core.optimizer.optimizer": (_port_multi_tensor_helpers, _torch_adams_step_in_param_groups),
    "megatron.core.transformer.torch_layer_norm": _serve_zero_centered_gamma_in_torch_norm,
    "megatron.core.transformer.torch_norm": _serve_zero_centered_gamma_in_torch_norm,
    "megatron.core.fusions.fused_layer_norm": _serve_rms_norm_in_fused_layer_norm,
    "megatron.core.transformer.dot_product_attention": _serve_mla_channels,
    "megatron.core.transformer.moe.grouped_gemm_util": _serve_grouped_gemm,
    "megatron.training.checkpointing": _no_fp8_params_to_fix_without_te,
    "megatron.training.arguments": _fp8_off_before_validation,
    "megatron.arguments": _fp8_off_before_validation,
    **{name: _te_norm_is_the_port_norm for name in _TE_NORM_USERS},
    **{name: _te_helpers_none for name in _TE_NONE_NAMES},
    # the TE-norm users that need more, each entry replacing its line above
    _GPT_SPECS_MODULE: (_te_norm_is_the_port_norm, _serve_te_layer_specs),
    "megatron.core.models.bert.bert_layer_specs": _serve_te_layer_specs,
    # core 0.9's local T5 block specs name TENorm too, defined only with TE
    "megatron.core.models.T5.t5_spec": (_te_norm_is_the_port_norm, _serve_te_layer_specs),
    "megatron.core.datasets.t5_dataset": _t5_masks_for_local_layers,
    "megatron.core.models.bert.bert_model": _bert_masks_for_local_layers,
    "megatron.legacy.model.transformer": _legacy_transformer_builds_local_layers,
    "megatron.model.transformer": _legacy_transformer_builds_local_layers,  # its name until 2024-03-26
    "megatron.core.models.backends": (_te_norm_is_the_port_norm, _say_grouped_gemm_runs_sequential,
                                       _te_backend_is_local),
    "megatron.core.transformer.multi_latent_attention": (_te_norm_is_the_port_norm, _mla_has_no_te,
                                                         _mla_query_norm_as_te_spec, _mla_duplicated_down_projections),
}


# What a module needs declared before upstream's own code in it runs, without TransformerEngine.
_BEFORE_IMPORT_WITHOUT_TE = {
    "megatron.core.models.bert.bert_layer_specs": _te_layer_names_declared,
}

#: The after-import tables, grouped by what they serve; all but the last whatever is installed.
AFTER_IMPORT_TABLES = (
    ("today's torch and NumPy", _AFTER_IMPORT_TARGET_STACK),
    ("upstream's own bugs in a window", _AFTER_IMPORT_UPSTREAM_FIXES),
    ("DeepSpeed", _AFTER_IMPORT_DEEPSPEED),
    ("core attention through SDPA", _AFTER_IMPORT_ATTENTION),
    ("TransformerEngine absent", _AFTER_IMPORT_WITHOUT_TE),
)


def after_import_steps(fullname: str) -> tuple:
    """Every step the port runs once ``fullname`` has loaded, table by table (:data:`AFTER_IMPORT_TABLES`;
    the TransformerEngine-absent one only without TransformerEngine): one module may take several."""
    steps = ()
    for _, table in AFTER_IMPORT_TABLES:
        if fullname in table and (table is not _AFTER_IMPORT_WITHOUT_TE or not te_absent._transformer_engine_installed()):
            steps += _steps(table[fullname])
    return steps


def before_import_steps(fullname: str) -> tuple:
    """What runs in ``fullname``'s namespace before upstream's code in it (TransformerEngine absent)."""
    if fullname in _BEFORE_IMPORT_WITHOUT_TE and not te_absent._transformer_engine_installed():
        return _steps(_BEFORE_IMPORT_WITHOUT_TE[fullname])
    return ()


class _ServeAfterImport(importlib.abc.MetaPathFinder):
    """Runs the steps of a module (:func:`before_import_steps`, :func:`after_import_steps`) around
    upstream's own code in it, and that code from its fixed source where upstream's later fix of a
    module-level statement is listed (``upstream_fixes._SOURCE_FIXES``): one mechanism for every era,
    whatever shape the file has."""

    def find_spec(self, fullname, path=None, target=None):
        before, after = before_import_steps(fullname), after_import_steps(fullname)
        if not before and not after and fullname not in _SOURCE_FIXES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            for step in before:
                step(module)
            code = _fixed_code(spec, fullname)
            if code is None:
                run(module)
            else:
                exec(code, module.__dict__)  # upstream's own code, as upstream's later fix has it
            for step in after:
                step(module)

        spec.loader.exec_module = exec_module
        return spec


def _fixed_code(spec, fullname: str):
    """The module's code with :data:`_SOURCE_FIXES`' changes, or None (its loader runs it as it is)."""
    if fullname not in _SOURCE_FIXES or not hasattr(spec.loader, "get_source"):
        return None
    source = spec.loader.get_source(fullname)
    return None if source is None else _fixed_module_code(fullname, source, spec.origin)


def install() -> None:
    """Everything the port changes in the process, once, when upstream imports it (first thing):
    the apex/extension blocker, today's stack's restored names, DeepSpeed's removed compression
    module, the TransformerEngine layers stand-in (eras that import it unguarded), and the
    after-import steps. Each is idempotent: importing the port again changes nothing more."""
    install_import_blocker()
    install_target_stack_compat()
    serve_removed_deepspeed_compression()
    if not TRANSFORMER_ENGINE_IMPORTS_GUARDED and not any(
            isinstance(f, _TransformerEngineLayersStandIn) for f in sys.meta_path):
        sys.meta_path.insert(1, _TransformerEngineLayersStandIn())
    if not any(isinstance(f, _ServeAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(1, _ServeAfterImport())
