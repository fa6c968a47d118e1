"""``mla-attention``: what Multi-Latent Attention needs of TransformerEngine, in plain PyTorch.

Unported upstream builds MLA's core attention with ``k_channels``/``v_channels`` (q/k head dim !=
v head dim), which only TE's attention takes; 2025-02 builds its down projections with TE's
``parallel_mode="duplicated"``; 2025-11 takes its TE extension module (importable, full of mocks)
for TE. The local DotProductAttention computes softmax(scale q k^T) v with any head dims once its
output width is heads x v_channels; at tensor-parallel size 1 a column-parallel linear is the
duplicated one. From 2026, TE's model norms the query inside its query projection when there is
no q LoRA (LayerNormColumnParallelLinear) and upstream's local spec cannot express it: the local
backend gets a norm-then-ColumnParallelLinear (the te-norm shim's norm) and MLA drops the separate
q_layernorm there. Written apart from the port's code.
"""

from __future__ import annotations

import copy

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "mla-attention"
DESCRIPTION = ("MLA's core attention with q/k head dim != v head dim in the local DotProductAttention; "
               "duplicated down projections as ColumnParallelLinear at TP 1; no TE where its module only mocks it")
ERAS = "E6-E8 (main 2025-01 on), --multi-latent-attention"
REPRODUCES = "TransformerEngine's DotProductAttention(k_channels, v_channels) and TELinear(parallel_mode='duplicated')"
PATTERN = (Match(("TypeError",), message=r"unexpected keyword argument 'k_channels'"),
           Match(("ValueError",), message=r"is non-trivial, but `q_lora_rank is None`"),
           Match(("TypeError",), message=r"unexpected keyword argument 'parallel_mode'"),
           Match(("TypeError",), message=r"isinstance\(\) arg 2 must be a type", file=r"multi_latent_attention\.py$"))


def attention_with_v_channels(module) -> None:
    cls = module.DotProductAttention
    init = cls.__init__

    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        if k_channels is not None:
            config = copy.copy(config)
            config.kv_channels = k_channels
        init(self, config, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    cls.__init__ = __init__


def no_te_in_mla(module) -> None:
    if getattr(module, "HAVE_TE", False):
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            module.HAVE_TE = False
    build = module.build_module

    def build_module(spec, *args, **kwargs):
        if kwargs.get("parallel_mode") == "duplicated" and getattr(spec, "__name__", "") == "ColumnParallelLinear":
            assert kwargs["config"].tensor_model_parallel_size == 1, "mla-attention shim: TP 1 only"
            del kwargs["parallel_mode"]
            kwargs["gather_output"] = False
        return build(spec, *args, **kwargs)

    module.build_module = build_module


def _query_norm_in_projection(cls) -> None:
    init = cls.__init__

    def __init__(self, config, submodules=None, *args, **kwargs):
        if config.q_lora_rank is None and getattr(submodules, "q_layernorm", None) not in (None,) and \
                getattr(submodules.q_layernorm, "__name__", "") != "IdentityOp":
            import dataclasses

            submodules = dataclasses.replace(submodules, q_layernorm=None)
        init(self, config, submodules, *args, **kwargs)

    cls.__init__ = __init__


def mla_query_norm(module) -> None:
    if hasattr(module.MLASelfAttention, "_resolve_qk_norm_config"):
        _query_norm_in_projection(module.MLASelfAttention)


def norm_then_linear(module) -> None:
    from megaport.train.shims.te_norm import TENormInTorch

    linear = module.ColumnParallelLinear

    class NormThenColumnParallelLinear(linear):
        def __init__(self, input_size, output_size, *args, config, **kwargs):
            super().__init__(input_size, output_size, *args, config=config, **kwargs)
            self.layer_norm = TENormInTorch(config, input_size, eps=config.layernorm_epsilon)

        def forward(self, x, *args, **kwargs):
            return super().forward(self.layer_norm(x), *args, **kwargs)

    module.LocalSpecProvider.column_parallel_layer_norm_linear = lambda self: NormThenColumnParallelLinear


def install() -> None:
    after_import("megatron.core.transformer.dot_product_attention", attention_with_v_channels)
    after_import("megatron.core.transformer.multi_latent_attention", no_te_in_mla)
    after_import("megatron.core.transformer.multi_latent_attention", mla_query_norm)
    after_import("megatron.core.models.backends", norm_then_linear)
