"""``te-norm``: TransformerEngine's norm (LayerNorm or RMSNorm, zero-centered gamma) in plain PyTorch.

Without TE, unported upstream cannot build Llama 3 (``--normalization RMSNorm --apply-layernorm-1p``):
torch's norm wrapper refuses zero-centered gamma, apex's FusedLayerNorm (2024's local spec) refuses
RMSNorm, and the MoE/MLA specs of 2025 name ``TENorm`` with no guard. Written from TE's documented
math (``y = norm(x) * (1 + w)`` with ``w`` stored centred at 0, fp32 arithmetic, the input's dtype
out), apart from the port's norm: a fault there must show as a parity failure.
"""

from __future__ import annotations

import importlib.util

import torch

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match
from megaport.train.tree_files import tree_says

NAME = "te-norm"
DESCRIPTION = ("TransformerEngine's norm in plain PyTorch (RMSNorm/LayerNorm, zero-centered gamma) where upstream's "
               "torch or apex norm refuses the config, or a spec names TENorm without TE (or binds upstream's TENorm "
               "wrapper, which refuses to build without TE); moe_utils' te_general_gemm, "
               "left undefined without TE in core 0.14-0.15, None (upstream's own no-TE value)")
ERAS = "E6-E8 (main 2024-06 on): Llama 3, Mixtral and DeepSeek-V2 specs"
REPRODUCES = "TransformerEngine's TENorm (te.pytorch.RMSNorm/LayerNorm, zero_centered_gamma)"
PATTERN = (Match(("AssertionError",), message=r"zero_centered_gamma not supported by torch"),
           Match(("AssertionError",), message=r"is not supported in FusedLayerNorm"),
           # core 0.9's torch LayerNorm wrapper refusing RMSNorm (its message's own wording)
           Match(("AssertionError",), message=r"is not supported in by torch Layernorm"),
           Match(("NameError",), message=r"name 'TENorm' is not defined"),
           Match(("NameError",), message=r"name 'te_general_gemm' is not defined"),
           # 2024's TENorm (with the transformer-engine stub) building TE's RMSNorm for the final norm
           Match(("TransformerEngineStubUsed",), code=r"te\.pytorch\.RMSNorm\("),
           # upstream's TENorm wrapper built without TE (the nano-v3-vl snapshot's block binds it unguarded)
           Match(("ImportError",), message=r"Transformer Engine is not installed.* when instantiating TENorm"))

_TE_NORM_MODULES = ("megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.gpt.moe_module_specs",
                    "megatron.core.models.backends", "megatron.core.transformer.attention",
                    "megatron.core.transformer.multi_latent_attention", "megatron.core.transformer.transformer_block",
                    "megatron.core.transformer.multi_token_prediction",
                    # core 0.9's local T5 block specs name TENorm, defined only with TE
                    "megatron.core.models.T5.t5_spec")


#: megatron.core's T5 specs, whose local block specs name TENorm for the final norm
_T5_SPEC = "megatron/core/models/T5/t5_spec.py"


def applies(tree: str) -> bool:
    """Where T5 lists it up front: the tree's local T5 block specs take their final norm from
    ``TENorm``. Without TE that name is undefined (core 0.9, a NameError the pattern answers anyway)
    or None (core 0.13 on), and None builds the encoder and decoder without their final norms, a
    different model, without any failure (core_v0.16.1: ported and unported 17x apart in grad norm
    from the first step). Other families meet their TENorm needs as failures."""
    return tree_says(tree, _T5_SPEC, "layer_norm=TENorm")


class TENormInTorch(torch.nn.Module):
    """TE's norm module: ``weight`` (and LayerNorm's ``bias``) of ``hidden_size``; the weight holds
    gamma - 1 when the config centres it."""

    def __init__(self, config, hidden_size, eps=1e-5, **unused):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"te-norm shim: normalization {config.normalization!r} is not LayerNorm or RMSNorm")
        self.centred = bool(config.layernorm_zero_centered_gamma)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 0.0 if self.centred else 1.0))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))
        for p in (self.weight, self.bias):
            if p is not None:
                p.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x):
        x32 = x.to(torch.float32 if x.dtype != torch.float64 else x.dtype)
        gamma = self.weight.to(x32.dtype)
        if self.centred:
            gamma = gamma + 1
        if self.rms:
            y = torch.nn.functional.rms_norm(x32, (x32.shape[-1],), gamma, self.eps)
        else:
            y = torch.nn.functional.layer_norm(x32, (x32.shape[-1],), gamma, self.bias.to(x32.dtype), self.eps)
        return y.to(x.dtype)


def _build_when(cls, refused) -> None:
    own_new = cls.__dict__.get("__new__")
    own_new = own_new.__func__ if isinstance(own_new, staticmethod) else own_new

    def __new__(klass, config=None, *args, **kwargs):
        if config is not None and refused(config):
            return TENormInTorch(config, *args, **kwargs)
        return own_new(klass, config, *args, **kwargs) if own_new else object.__new__(klass)

    cls.__new__ = staticmethod(__new__)


def torch_norms(module) -> None:
    for name in ("WrappedTorchNorm", "WrappedTorchLayerNorm"):
        if hasattr(module, name):
            layer_norm_only = name == "WrappedTorchLayerNorm"
            _build_when(getattr(module, name), lambda c, only=layer_norm_only: bool(c.layernorm_zero_centered_gamma)
                        or (only and c.normalization != "LayerNorm"))


def apex_norm(module) -> None:
    if hasattr(module, "FusedLayerNorm"):
        _build_when(module.FusedLayerNorm, lambda c: c.normalization != "LayerNorm")


#: upstream's TENorm wrapper, which raises as it is built where TE is not installed
_WRAPPER_MODULE = "megatron.core.extensions.transformer_engine"


def te_norm_name(module) -> None:
    """TENorm where a module names it: undefined or None without TE, or upstream's wrapper, which
    without TE refuses to build (and the block's LayerNormImpl with it, where that is the wrapper)."""
    named = getattr(module, "TENorm", None)
    wrapper = (named is not None and getattr(named, "__module__", None) == _WRAPPER_MODULE
               and importlib.util.find_spec("transformer_engine") is None)
    if named is None or wrapper:
        module.TENorm = TENormInTorch
    if wrapper and getattr(module, "LayerNormImpl", None) is named:
        module.LayerNormImpl = TENormInTorch


def router_gemm_helper(module) -> None:
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None


def te_layers_norm(module) -> None:
    module.TENorm = TENormInTorch


def install() -> None:
    after_import("megatron.core.transformer.custom_layers.transformer_engine", te_layers_norm)
    after_import("megatron.core.transformer.moe.moe_utils", router_gemm_helper)
    after_import("megatron.core.transformer.torch_norm", torch_norms)
    after_import("megatron.core.transformer.torch_layer_norm", torch_norms)
    after_import("megatron.core.fusions.fused_layer_norm", apex_norm)
    for name in _TE_NORM_MODULES:
        after_import(name, te_norm_name)
