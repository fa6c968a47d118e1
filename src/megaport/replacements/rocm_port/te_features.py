"""What Llama 3, Mixtral and DeepSeek-V2 need of TransformerEngine and apex (norms with RMSNorm and
zero-centered gamma, MoE's grouped GEMM, MLA's attention and projections, FP8 switched off), served
in PyTorch: upstream's local layers refuse them, and TE's are absent."""

from __future__ import annotations

import functools
import inspect
import types

import torch

from . import te_absent
from .say import say_once
from .softmax import _run_compiled


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``), with zero-centered gamma when
    ``config.layernorm_zero_centered_gamma`` (``--apply-layernorm-1p``): what TENorm computes.

    Upstream's local norms refuse RMSNorm (apex's FusedLayerNorm) or zero-centered gamma (torch's
    wrapper), and TE's norm is absent: Llama 3 (RMSNorm + 1p) and the MoE/MLA specs (which name
    TENorm) need one that does both. As in TE, the weight is stored as gamma - 1 when centered and
    the math (gamma + 1 included) runs in fp32, the result in the input's dtype.
    """

    def __init__(self, config, hidden_size, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization=None, **kwargs):
        super().__init__()
        self.config = config
        self.normalization = getattr(config, "normalization", None) or normalization or "LayerNorm"
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {self.normalization!r}: the port's norm serves LayerNorm and RMSNorm")
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False) or zero_centered_gamma)
        shape = (hidden_size,) if isinstance(hidden_size, int) else tuple(hidden_size)
        self.hidden_size = torch.Size(shape)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(shape))
        self.bias = torch.nn.Parameter(torch.empty(shape)) if self.normalization == "LayerNorm" else None
        self.reset_parameters()
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        for p in (self.weight, self.bias):
            if p is not None:
                setattr(p, "sequence_parallel", sequence_parallel)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.weight, self.bias, self.normalization, self.eps, self.zero_centered_gamma)
        if input.numel():
            # one kernel per pass where Triton is (see _run_compiled); the eager math has up to
            # seven, each reading or writing an fp32 copy of the activations
            out = _run_compiled("norm", ("norm", input.dtype, self.normalization, self.zero_centered_gamma),
                                norm_forward, input.device, *args)
            if out is not None:
                return out
        return norm_forward(*args)


def norm_forward(input, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
    """TE's norm: fp32 math, ``gamma = weight + 1`` when zero-centered, output in ``input``'s dtype."""
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    x = input.to(compute)
    gamma = weight.to(compute) + 1.0 if zero_centered_gamma else weight.to(compute)
    if normalization == "RMSNorm":
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), gamma, None if bias is None else bias.to(compute), eps)
    return y.to(input.dtype)


def _norm_for_what_upstream_refuses(cls, refuses) -> None:
    """``cls(...)`` gives the port's :class:`Norm` where ``refuses(config)``; otherwise upstream's own.

    Done in ``__new__`` (upstream's WrappedTorchNorm builds there, FusedLayerNorm in __init__) so
    the specs keep naming upstream's class."""
    if getattr(cls, "_rocm_port_norm", False):
        return
    previous = cls.__dict__.get("__new__")
    previous = previous.__func__ if isinstance(previous, staticmethod) else previous

    def __new__(klass, config=None, *args, **kwargs):
        if config is not None and refuses(config):
            return Norm(config, *args, **kwargs)
        if previous is not None:
            return previous(klass, config, *args, **kwargs)
        return object.__new__(klass)

    cls.__new__ = staticmethod(__new__)
    cls._rocm_port_norm = True


def _refused_by_apex_layer_norm(config) -> bool:
    return getattr(config, "normalization", "LayerNorm") != "LayerNorm"


def _refused_by_torch_norm(config) -> bool:
    """Upstream's torch norm wrapper asserts no zero-centered gamma and no sequence parallelism
    (only TE's norm took them); the port's norm takes both, and marks its parameters
    ``sequence_parallel`` so the TP ranks all-reduce their gradients (upstream issues #1446, #1448:
    norms drift apart silently without the mark)."""
    if getattr(config, "sequence_parallel", False):
        say_once("sequence parallelism without TransformerEngine: the port's norm in place of upstream's torch norm, "
                 "its weights marked sequence_parallel (gradients all-reduced across the TP ranks)")
        return True
    return bool(getattr(config, "layernorm_zero_centered_gamma", False))


def _serve_rms_norm_in_fused_layer_norm(module) -> None:
    """apex's FusedLayerNorm (the local spec's norm until 2024) asserts LayerNorm: RMSNorm builds
    the port's norm."""
    cls = getattr(module, "FusedLayerNorm", None)
    if cls is not None:
        _norm_for_what_upstream_refuses(cls, _refused_by_apex_layer_norm)


def _serve_zero_centered_gamma_in_torch_norm(module) -> None:
    """torch's norm wrappers (the local norm from core 0.9) assert no zero-centered gamma; with it
    (``--apply-layernorm-1p``) they build the port's norm. The persist flag first: it wraps the
    method upstream checks in (WrappedTorchLayerNorm's ``__init__``), which a ``__new__`` of the
    port's would otherwise hide from it."""
    te_absent._ignore_persist_layer_norm(module)
    for name in ("WrappedTorchNorm", "WrappedTorchLayerNorm"):
        cls = getattr(module, name, None)
        if cls is not None:
            refuses = _refused_by_torch_norm
            if name == "WrappedTorchLayerNorm":  # it builds LayerNorm only
                refuses = lambda c: _refused_by_torch_norm(c) or _refused_by_apex_layer_norm(c)
            _norm_for_what_upstream_refuses(cls, refuses)


# Modules whose specs or layers name TE's norm, guarded to None (or left undefined) without TE.
_TE_NORM_USERS = ("megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.gpt.moe_module_specs",
                  "megatron.core.models.backends", "megatron.core.transformer.attention",
                  "megatron.core.transformer.multi_latent_attention", "megatron.core.transformer.transformer_block",
                  "megatron.core.transformer.multi_token_prediction")


def _names(module, name: str) -> bool:
    """Whether ``module``'s source names ``name`` (a module that never uses it gets nothing)."""
    path = getattr(module, "__file__", None)
    if not path:
        return True
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return name in source.read()
    except OSError:
        return True


#: where upstream's TENorm wrapper lives: without TE it raises as it is built ("Transformer Engine is
#: not installed"), so a module that bound it (the nano-v3-vl snapshot's transformer block imports it
#: unguarded, the extension module importing without TE, and makes it its LayerNormImpl) builds no model
_TE_EXTENSIONS = "megatron.core.extensions.transformer_engine"


def _te_norm_is_the_port_norm(module) -> None:
    """``TENorm`` (and ``LayerNormImpl`` where it is TE's) is the port's :class:`Norm`: the MoE and
    MLA specs name it with no guard (a NameError, or None built as a module, without TE), and a
    module that bound upstream's wrapper would build one that raises."""
    bound = getattr(module, "TENorm", None)
    wrapper = bound is not None and getattr(bound, "__module__", None) == _TE_EXTENSIONS
    if (bound is None and _names(module, "TENorm")) or wrapper:
        module.TENorm = Norm
        if wrapper and getattr(module, "LayerNormImpl", None) is bound:
            module.LayerNormImpl = Norm
        say_once("TransformerEngine is not installed: TENorm is the port's PyTorch norm "
                 "(LayerNorm or RMSNorm, zero-centered gamma as TE)")


# TE helpers a module tests against None before use but leaves undefined without TE (core 0.14-0.15's
# moe_utils: the router's GEMM); None is upstream's own "no TE" value there, which runs it in PyTorch.
_TE_NONE_NAMES = {"megatron.core.transformer.moe.moe_utils": ("te_general_gemm",)}


def _te_helpers_none(module) -> None:
    """TE helpers upstream tests against None, where the module leaves them undefined without TE."""
    for name in _TE_NONE_NAMES.get(module.__name__, ()):
        if not hasattr(module, name):
            setattr(module, name, None)


def _mla_has_no_te(module) -> None:
    """Core 0.14-0.16 set MLA's HAVE_TE when its TE extension module imports, which it does without
    TE (its TE names are mocks): isinstance(linear_proj, TELinear) then raises. There is no TE."""
    if getattr(module, "HAVE_TE", False):
        module.HAVE_TE = False


def _say_grouped_gemm_runs_sequential(module) -> None:
    """From 2025-12 the local backend builds SequentialMLP whatever ``--moe-grouped-gemm`` says:
    upstream's own fallback, said once."""
    cls = getattr(module, "LocalSpecProvider", None)
    original = getattr(cls, "grouped_mlp_modules", None)
    if original is None or getattr(original, "_rocm_port", False):
        return

    @functools.wraps(original)
    def grouped_mlp_modules(self, moe_use_grouped_gemm, *args, **kwargs):
        if moe_use_grouped_gemm:
            say_once("--moe-grouped-gemm needs TransformerEngine's grouped linear: the experts run as upstream's "
                     "SequentialMLP (one GEMM per expert, the same math)")
        return original(self, moe_use_grouped_gemm, *args, **kwargs)

    grouped_mlp_modules._rocm_port = True
    cls.grouped_mlp_modules = grouped_mlp_modules


def _serve_mla_channels(module) -> None:
    """MLA builds its core attention with ``k_channels`` (qk head dim + rope dim) and
    ``v_channels`` (v head dim), which only TE's attention takes. The local DotProductAttention
    computes the same with them: scores over the k head dim, the softmax scale MLA passes (or
    1/sqrt(k_channels), TE's default), context of np x v_channels."""
    cls = getattr(module, "DotProductAttention", None)
    if cls is None or getattr(cls, "_rocm_port_channels", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        if k_channels is None and v_channels is None:
            return original(self, *args, **kwargs)
        config = kwargs.get("config", args[0] if args else None)
        import copy

        config = copy.copy(config)
        config.kv_channels = k_channels if k_channels is not None else config.kv_channels
        if args:
            args = (config,) + tuple(args[1:])
        else:
            kwargs["config"] = config
        original(self, *args, **kwargs)
        if v_channels is not None:
            heads = self.num_attention_heads_per_partition
            self.hidden_size_per_partition = v_channels * heads
            self.hidden_size_per_attention_head_v = v_channels
        say_once("MLA's core attention (k_channels != v_channels) runs in the local DotProductAttention "
                 "(PyTorch), not TransformerEngine's")

    cls.__init__ = __init__
    cls._rocm_port_channels = True


def _mla_query_norm_as_te_spec(module) -> None:
    """From 2026 MLA resolves its query/key norms at build time through the TE backend: with
    ``--qk-layernorm`` and no ``--q-lora-rank`` (DeepSeek-V2-Lite) TE's model norms the hidden
    states inside its query projection (LayerNormColumnParallelLinear), and rejects the separate
    q_layernorm the local spec (which the port builds in TE's place) names. With
    ``--transformer-impl transformer_engine`` that q_layernorm is left out, so the query projection
    is the fused norm + linear the port's TE backend gives (:func:`_te_backend_is_local`), as in TE.
    Eras that build MLA's q_layernorm only with a q LoRA are left as they are."""
    cls = getattr(module, "MLASelfAttention", None)
    if cls is None or not hasattr(cls, "_resolve_qk_norm_config") or getattr(cls, "_rocm_port_q_norm", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, config, submodules=None, *args, **kwargs):
        wanted_te = getattr(config, "transformer_impl", "transformer_engine") == "transformer_engine"
        q_norm = getattr(submodules, "q_layernorm", None)
        if (wanted_te and getattr(config, "q_lora_rank", None) is None and q_norm is not None
                and getattr(q_norm, "__name__", "") != "IdentityOp"):
            import dataclasses

            submodules = dataclasses.replace(submodules, q_layernorm=None)
            say_once("MLA with --qk-layernorm and no --q-lora-rank: the query norm sits in the query projection as in "
                     "TransformerEngine's model (the port's norm, then ColumnParallelLinear)")
        return original(self, config, submodules, *args, **kwargs)

    cls.__init__ = __init__
    cls._rocm_port_q_norm = True


def _norm_then(linear_cls):
    """TE's LayerNormColumnParallelLinear in PyTorch: the port's :class:`Norm` (the config's
    normalization, epsilon and zero-centered gamma) and then ``linear_cls``."""

    class NormColumnParallelLinear(linear_cls):
        def __init__(self, input_size, output_size, *args, config, **kwargs):
            super().__init__(input_size, output_size, *args, config=config, **kwargs)
            self.layer_norm = Norm(config, input_size, eps=getattr(config, "layernorm_epsilon", 1e-5))

        def forward(self, input_, *args, **kwargs):
            return super().forward(self.layer_norm(input_), *args, **kwargs)

    NormColumnParallelLinear.__qualname__ = NormColumnParallelLinear.__name__
    return NormColumnParallelLinear


def _te_backend_is_local(module) -> None:
    """``get_backend("transformer_engine")`` (2025-12 on; MLA resolves its layers through it) gives
    the local backend without TE, with the port's norm + ColumnParallelLinear as its fused
    norm-linear: TE's backend there hands out mock classes."""
    get_backend, local = getattr(module, "get_backend", None), getattr(module, "LocalSpecProvider", None)
    if get_backend is None or local is None or getattr(get_backend, "_rocm_port", False):
        return
    fused = _norm_then(module.ColumnParallelLinear)

    class PortSpecProvider(local):
        """The local backend where TransformerEngine's was asked for."""

        def column_parallel_layer_norm_linear(self):
            return fused

    @functools.wraps(get_backend)
    def wrapped(transformer_impl, *args, **kwargs):
        if transformer_impl == "transformer_engine" and not te_absent._transformer_engine_installed():
            return PortSpecProvider()
        return get_backend(transformer_impl, *args, **kwargs)

    wrapped._rocm_port = True
    module.get_backend = wrapped


def _mla_duplicated_down_projections(module) -> None:
    """MLA of 2025-01 … 2025-05 builds its down projections with TE's ``parallel_mode="duplicated"``
    whatever the spec names; the local spec names ColumnParallelLinear, which takes no such
    argument (upstream later passed it ``gather_output=False`` instead). At tensor-parallel size 1
    a column-parallel linear is the duplicated one; above it, it would not be: an error."""
    build = getattr(module, "build_module", None)
    if build is None or getattr(build, "_rocm_port_duplicated", False):
        return

    @functools.wraps(build)
    def build_module(spec, *args, **kwargs):
        target = getattr(spec, "module", spec)
        if kwargs.get("parallel_mode") == "duplicated" and isinstance(target, type) and \
                "parallel_mode" not in inspect.signature(target.__init__).parameters:
            config = kwargs.get("config")
            if getattr(config, "tensor_model_parallel_size", 1) != 1:
                raise ValueError(f"MLA's duplicated down projection needs TransformerEngine's linear at "
                                 f"tensor-parallel size {config.tensor_model_parallel_size}; {target.__name__} "
                                 "would split it (use tensor-parallel size 1)")
            kwargs.pop("parallel_mode")
            kwargs.setdefault("gather_output", False)
            say_once(f"MLA's down projections ask for TransformerEngine's duplicated linear: built as "
                     f"{target.__name__} (the same at tensor-parallel size 1)")
        return build(spec, *args, **kwargs)

    build_module._rocm_port_duplicated = True
    module.build_module = build_module


def _gmm(a, b, batch_sizes, trans_b: bool = False):
    """grouped_gemm's ``ops.gmm``: rows of ``a`` taken ``batch_sizes[e]`` at a time times ``b[e]``
    (or its transpose), one matmul per expert; autograd gives the backward."""
    say_once("--moe-grouped-gemm needs the grouped_gemm package (not installed): its grouped GEMM runs in "
             "PyTorch, one matmul per expert (the same math)")
    sizes = [int(s) for s in (batch_sizes.tolist() if torch.is_tensor(batch_sizes) else batch_sizes)]
    if len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: batch_sizes {sizes} do not split {a.shape[0]} rows over {b.shape[0]} experts")
    outs = [chunk @ (w.t() if trans_b else w) for chunk, w in zip(torch.split(a, sizes), b.unbind(0))]
    if not outs:
        return a.new_empty((0, b.shape[1] if trans_b else b.shape[2]))
    return torch.cat(outs)


#: Stands in for the ``grouped_gemm`` package where upstream's legacy GroupedMLP uses it.
grouped_gemm = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=_gmm))


def _serve_grouped_gemm(module) -> None:
    """Without the grouped_gemm package the legacy GroupedMLP (``--moe-grouped-gemm`` with the
    local spec, core 0.8-0.15) asserts it is there: it gets the port's PyTorch gmm."""
    if getattr(module, "grouped_gemm", None) is None:
        module.grouped_gemm = grouped_gemm
        module.ops = grouped_gemm.ops


def _precision(args) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


# FP8 flags that only mean something when --fp8-format is on; switched off with it.
_FP8_COMPANIONS = ("fp8_param_gather", "fp8_param")


def switch_off_fp8(args) -> bool:
    """``--fp8-format`` needs TransformerEngine's FP8 layers; without TE upstream would train in
    the 16-bit dtype without a word. It is switched off on ``args``, said once."""
    fmt = getattr(args, "fp8", None)
    if not fmt:
        return False
    recipe = getattr(args, "fp8_recipe", None)
    args.fp8 = None
    for name in _FP8_COMPANIONS:
        if getattr(args, name, False):
            setattr(args, name, False)
    say_once(f"--fp8-format {fmt}{f' (--fp8-recipe {recipe})' if recipe else ''} needs TransformerEngine, which "
             f"is not installed: switched off, training runs in {_precision(args)}")
    return True


def _fp8_off_before_validation(module) -> None:
    """Wraps ``validate_args`` so FP8 is switched off before upstream checks the arguments."""
    original = getattr(module, "validate_args", None)
    if original is None or getattr(original, "_rocm_port_fp8", False):
        return

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        switch_off_fp8(args)
        return original(args, *rest, **kwargs)

    validate_args._rocm_port_fp8 = True
    module.validate_args = validate_args


def _no_fp8_params_to_fix_without_te(module) -> None:
    """Upstream from 062c833392 (2025-04-02) to 72afd63ccb (2025-04-28), and the core 0.12 release
    line: loading a distributed checkpoint asks ``is_te_min_version("2.0")`` first thing in
    ``fix_fp8_params_lose_precision_when_loading_dist_ckpt``, which imports TE, so no run resumes
    or starts from a ``torch_dist`` checkpoint without it (``ModuleNotFoundError``). Without TE no
    parameter is FP8, and the function changes nothing, as with ``--fp8-param-gather`` off."""
    fix = getattr(module, "fix_fp8_params_lose_precision_when_loading_dist_ckpt", None)
    if fix is None or getattr(fix, "_rocm_port", False):
        return

    @functools.wraps(fix)
    def fix_fp8_params_lose_precision_when_loading_dist_ckpt(state_dict):
        say_once("TransformerEngine is not installed: a distributed checkpoint loads without the FP8 parameter "
                 "fix, which asks TE's version (no parameter is FP8 without TE)")
        return None

    fix_fp8_params_lose_precision_when_loading_dist_ckpt._rocm_port = True
    module.fix_fp8_params_lose_precision_when_loading_dist_ckpt = fix_fp8_params_lose_precision_when_loading_dist_ckpt


def _no_fp8_shard_to_quantize_without_te(module) -> None:
    """Upstream from 062c833392 (2025-04-02) to 76203e757e (2025-07-15): without TE, fp8_utils'
    fallback ``quantize_param_shard`` raises even when there is no FP8 parameter to quantize, and
    the distributed optimizer calls it after every step, so no ``--use-distributed-optimizer`` run
    trains (Mixtral's script on core 0.12). With nothing to quantize it returns, as 76203e757e."""
    impl = getattr(module, "_quantize_param_shard_impl", None)
    if impl is None or getattr(impl, "_rocm_port", False):
        return

    @functools.wraps(impl)
    def _quantize_param_shard_impl(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return impl(model_params, *args, **kwargs)

    _quantize_param_shard_impl._rocm_port = True
    module._quantize_param_shard_impl = _quantize_param_shard_impl
