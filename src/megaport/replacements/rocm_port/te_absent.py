"""TransformerEngine absent (never on ROCm): its layers module served as stand-ins in the eras that
import it unguarded, and its layer specs, fused RoPE and multi-tensor helpers served by Megatron's
local PyTorch ones, so upstream's TE defaults build the same model; and Megatron-Bridge's unguarded
TE import (the converter upstream's docs name for Llama since 2026-05) guarded before it runs."""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.util
import inspect

from . import attention
from .apex_substitutes import amp_C, multi_tensor_applier
from .say import say_once

# From 2023-07 to 2024-06 upstream's attention, transformer block and GPT layer specs import
# names from this module at module level with no guard, and the module imports
# transformer_engine first thing: without TransformerEngine (never on ROCm) not even the local,
# pure-PyTorch model imports.  Later eras guard those imports themselves, with these fallbacks.
_TE_LAYERS_MODULE = "megatron.core.transformer.custom_layers.transformer_engine"
# Names upstream tests against None before use: None is its own "no TransformerEngine" value.
_TE_OPTIONAL = ("SplitAlongDim", "get_cpu_offload_context", "te_checkpoint", "TEDelayedScaling")


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _te_layers_attribute(name: str):
    """What ``from <TE layers module> import name`` gives without TransformerEngine."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _TE_OPTIONAL:
        return None
    if name == "TENorm":  # the final layer norm: apex's FusedLayerNorm, served by the port
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        return FusedLayerNorm

    def needs_transformer_engine(*args, **kwargs):
        raise RuntimeError(f"{name} needs TransformerEngine, which is not installed (ROCm has none): "
                           "use --transformer-impl local")

    if not name[:1].isupper():
        return needs_transformer_engine
    return type(name, (), {"__init__": needs_transformer_engine, "__module__": _TE_LAYERS_MODULE})


class _TransformerEngineLayersStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the TE layers module as stand-ins when TransformerEngine is not installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TE_LAYERS_MODULE or _transformer_engine_installed():
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__getattr__ = _te_layers_attribute
        module.HAVE_TE = False
        say_once("TransformerEngine is not installed: its layers module gives TENorm as FusedLayerNorm "
                 "(PyTorch), None for its optional helpers, and TE-only layers that raise if built")


_GPT_SPECS_MODULE = "megatron.core.models.gpt.gpt_layer_specs"
# (TE spec, local spec) pairs of upstream's GPT layer specs: *_submodules builders from 2026,
# spec builders from core 0.5, module-level specs before. In every era without TransformerEngine
# (the release series also wrap them in the file; wrapping twice changes nothing).
_TE_SPEC_PAIRS = (("get_gpt_layer_with_transformer_engine_submodules", "get_gpt_layer_local_submodules"),
                  ("get_gpt_layer_with_transformer_engine_spec", "get_gpt_layer_local_spec"),
                  ("gpt_layer_with_transformer_engine_spec", "gpt_layer_local_spec"),
                  ("gpt_layer_with_transformer_engine_spec_moe", "gpt_layer_local_spec_moe"),
                  # BERT's (pretrain_bert.py takes the TE spec unless --spec local) and T5's
                  ("get_bert_layer_with_transformer_engine_spec", "bert_layer_local_spec"),
                  ("bert_layer_with_transformer_engine_spec", "bert_layer_local_spec"),
                  ("get_t5_encoder_with_transformer_engine_block_spec", "get_t5_encoder_with_local_block_spec"),
                  ("get_t5_decoder_with_transformer_engine_block_spec", "get_t5_decoder_with_local_block_spec"),
                  ("encoder_model_with_transformer_engine_default_spec", "encoder_model_with_local_spec"),
                  ("decoder_model_with_transformer_engine_default_spec", "decoder_model_with_local_spec"))
#: The spec modules whose TE specs the port serves with the local ones.
_SPEC_MODULES = (_GPT_SPECS_MODULE, "megatron.core.models.bert.bert_layer_specs", "megatron.core.models.T5.t5_spec")
#: TE layer classes that spec modules name at module level after a guarded import (BERT's spec in
#: core 0.8 to 0.15): declared before the module runs, as the stand-ins that raise if built.
_TE_LAYER_NAMES = ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear",
                   "TEColumnParallelLinear")


def _serve_te_layer_specs(module) -> None:
    """Without TransformerEngine the TE layer specs give the local layers: upstream's default
    ``--transformer-impl transformer_engine`` (and, in 2023-2024, ``--use-mcore-models``, which
    takes the TE spec whatever --transformer-impl says) then builds the same model in PyTorch."""
    for te_name, local_name in _TE_SPEC_PAIRS:
        te = module.__dict__.get(te_name)  # not through a module __getattr__ (core 0.16's BERT builds it)
        local = getattr(module, local_name, None)
        if te is None or local is None:
            continue
        if inspect.isroutine(te):  # a spec builder (a ModuleSpec is callable too: it builds its module)
            builder = local if inspect.isroutine(local) else (lambda _spec=local: _spec)
            setattr(module, te_name, local_spec_without_transformer_engine(te, builder))
        else:
            setattr(module, te_name, local)
            say_once(f"TransformerEngine is not installed: {te_name} builds Megatron's local PyTorch layers "
                     "instead (the same model)")


def _t5_masks_for_local_layers(module) -> None:
    """From 2024-11 pretrain_t5.py shapes its attention masks by ``--transformer-impl``: TE's
    layers take [b, 1, 1, s] padding masks, the local ones [b, 1, sq, sk]. Without TE the port builds
    the local layers for the TE spec, so the masks are the local layers' too."""
    cls = getattr(module, "T5MaskedWordPieceDataset", None)
    original = getattr(cls, "config_attention_mask", None)
    if original is None or getattr(original, "_rocm_port_local", False):
        return
    signature = inspect.signature(original)
    if "use_local" not in signature.parameters:
        return

    @functools.wraps(original)
    def config_attention_mask(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["use_local"] = True
        return original(*bound.args, **bound.kwargs)

    config_attention_mask._rocm_port_local = True
    cls.config_attention_mask = staticmethod(config_attention_mask)


def _bert_masks_for_local_layers(module) -> None:
    """From 104f7dcd3d (2024-08-05) to 6b35ca80e8 (2024-09-18) BertModel asked TE's version for its
    TE spec, unguarded (``PackageNotFoundError``). Without TE that spec builds local layers: [b, 1, s, s].
    (The method kept upstream's spelling "santiy" until core 0.10, whose check asks for no version.)"""
    cls = getattr(module, "BertModel", None)
    if getattr(cls, "_santiy_check_attention_and_get_attn_mask_dimension", None) is None:
        return

    def local_layers_mask(self, *args, **kwargs):
        say_once("TransformerEngine is not installed: BERT's TE spec builds local layers, whose attention mask is "
                 "[b, 1, s, s] (TE's version is not asked)")
        return "b1ss"

    cls._santiy_check_attention_and_get_attn_mask_dimension = local_layers_mask


def _legacy_transformer_builds_local_layers(module) -> None:
    """Upstream's default ``--transformer-impl`` became ``transformer_engine`` on 2024-04-03
    (afa331868f), while ``pretrain_gpt.py`` still built the legacy model unless told
    ``--use-mcore-models`` (until 53f901c662, 2024-06-07); the legacy ``ParallelTransformer`` then
    imports TE to build TE's TransformerLayer (``ModuleNotFoundError``): the docs' Llama flags of main
    2024-06-04 … 06-07 (docs/llama_mistral.md has no ``--use-mcore-models``) trained nothing without
    TE. Without TE the legacy transformer builds its local layers, the same model, said once; the
    run's arguments say ``local`` from then on, so nothing later asks for TE's layers either."""
    cls = getattr(module, "ParallelTransformer", None)
    init = cls.__dict__.get("__init__") if cls is not None else None
    if init is None or getattr(init, "_rocm_port_local", False) or not hasattr(module, "get_args"):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        run_args = module.get_args()
        if getattr(run_args, "transformer_impl", "local") == "transformer_engine":
            run_args.transformer_impl = "local"
            say_once("TransformerEngine is not installed: the legacy model's --transformer-impl transformer_engine "
                     "(upstream's default from 2024-04-03) builds Megatron's local PyTorch layers instead (the same "
                     "model)")
        init(self, *args, **kwargs)

    __init__._rocm_port_local = True
    cls.__init__ = __init__


def _te_layer_names_declared(module) -> None:
    """Before a spec module runs: TE layer names it uses at module level exist (as stand-ins that
    raise if built), so its TE spec is defined and then served with the local one."""
    for name in _TE_LAYER_NAMES:
        module.__dict__.setdefault(name, _te_layers_attribute(name))


def _ignore_persist_layer_norm(module) -> None:
    """torch's LayerNorm wrapper asserts ``not persist_layer_norm``, which upstream turns on by
    default; without apex there is no persistent kernel, and torch's LayerNorm computes the same
    values: the flag is ignored, said once."""
    for name in ("WrappedTorchLayerNorm", "WrappedTorchNorm"):
        cls = getattr(module, name, None)
        if cls is None or getattr(cls, "_rocm_port_persist_ignored", False):
            continue
        # WrappedTorchLayerNorm checks in __init__; WrappedTorchNorm (2024-10 on) in __new__.
        method = "__new__" if "__new__" in cls.__dict__ else "__init__"
        original = cls.__dict__[method]
        original = original.__func__ if isinstance(original, staticmethod) else original

        @functools.wraps(original)
        def wrapped(first, config, *args, _original=original, **kwargs):
            if getattr(config, "persist_layer_norm", False):
                import copy

                say_once("persist_layer_norm (on by default) needs apex's persistent layer-norm kernel: "
                         "ignored, torch's LayerNorm computes the same values")
                config = copy.copy(config)
                config.persist_layer_norm = False
            return _original(first, config, *args, **kwargs)

        setattr(cls, method, staticmethod(wrapped) if method == "__new__" else wrapped)
        cls._rocm_port_persist_ignored = True


def _port_multi_tensor_helpers(module) -> None:
    """Without TE and apex, clip_grads.py and optimizer.py (core 0.7 on) fall back to upstream's
    local multi-tensor helpers, which compute bf16 norms in bf16 and sync the host per tensor; the
    port's amp_C stand-ins (foreach kernels, fp32 norms) serve them instead, as apex would. Names
    bound to anything but the local fallbacks are left as they are."""
    port = {"multi_tensor_applier": multi_tensor_applier, "l2_norm_impl": amp_C.multi_tensor_l2norm,
            "multi_tensor_scale_impl": amp_C.multi_tensor_scale}
    local = [name for name in port if getattr(getattr(module, name, None), "__name__", "").startswith("local_multi_tensor")]
    for name in local:
        setattr(module, name, port[name])
    if local:
        say_once("apex is not installed: the grad-norm and grad-scale helpers are the port's amp_C stand-ins "
                 "(fp32 norms), not upstream's local fallback")


def _rope_fusion_off_before_checks(module) -> None:
    """TransformerConfig's checks raise when ``apply_rope_fusion`` (on by default from core 0.8)
    finds no fused RoPE kernel, which only TE (or apex, which the port blocks) has; the port
    switches it off, said once, before those checks run (every shape the check took)."""
    cls = getattr(module, "TransformerConfig", None)
    if cls is None or "__post_init__" not in cls.__dict__ or getattr(cls, "_rocm_port_rope", False):
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if getattr(self, "apply_rope_fusion", False):
            switch_off_rope_fusion(self)
        return original(self, *args, **kwargs)

    cls.__post_init__ = __post_init__
    cls._rocm_port_rope = True


def switch_off_rope_fusion(config) -> bool:
    """``apply_rope_fusion`` (on by default) needs TransformerEngine's fused RoPE kernel, which
    ROCm lacks: turn it off on ``config`` and say so once, where upstream raised."""
    config.apply_rope_fusion = False
    say_once("apply_rope_fusion (on by default) needs TransformerEngine's fused RoPE kernel: "
             "switched off, RoPE runs unfused in PyTorch")
    return True


def local_spec_without_transformer_engine(te_spec, local_spec):
    """``te_spec`` where TransformerEngine is installed; otherwise ``local_spec``, said once.

    The pair is upstream's GPT layer spec builders (or, from 2026, the *_submodules builders
    they delegate to). ``--transformer-impl transformer_engine`` is upstream's default and every
    example script's; ROCm has no TransformerEngine, so the same model is built from Megatron's
    local PyTorch layers (with the port's softmax and layer norm).  Arguments are passed on by name; a
    TE-only option that is switched on is an error, not silently dropped.
    """

    @functools.wraps(te_spec)
    def spec(*args, **kwargs):
        if _transformer_engine_installed():
            return te_spec(*args, **kwargs)
        given = inspect.signature(te_spec).bind(*args, **kwargs).arguments
        accepted = inspect.signature(local_spec).parameters
        te_only = sorted(k for k, v in given.items() if k not in accepted and v and k != "fp8")
        if te_only:
            raise ValueError(f"{', '.join(te_only)} need(s) TransformerEngine, which is not installed "
                             "(ROCm has none): turn them off or use --transformer-impl local")
        attention._TE_ATTENTION_SERVED = True  # the attention asked for is TE's fused one
        say_once("TransformerEngine is not installed: --transformer-impl transformer_engine builds "
                 "Megatron's local PyTorch layers instead (the same model)")
        return local_spec(**{k: v for k, v in given.items() if k in accepted})

    return spec


_BRIDGE_LORA = ("Megatron-Bridge's LoRA layers import TransformerEngine unconditionally (megatron/bridge/peft/"
                "lora_layers.py, which every 'from megatron.bridge import AutoBridge' imports): imported where TE "
                "is installed; without it Bridge converts and trains, its TE-fused LoRA is unavailable")


def _import_guarded(statement: ast.stmt, name: str) -> ast.Try:
    """``statement`` (an import) inside ``try``, with ``name = None`` on ImportError: how upstream
    guards an optional TransformerEngine import, and how the port's source fixes do."""
    missing = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Constant(value=None))
    handler = ast.ExceptHandler(type=ast.Name(id="ImportError", ctx=ast.Load()), name=None, body=[missing])
    return ast.copy_location(ast.Try(body=[statement], handlers=[handler], orelse=[], finalbody=[]), statement)


class _ImportFromGuarded(ast.NodeTransformer):
    """A module-level ``from MODULE import NAME [as ALIAS]`` -> the same inside ``try``, the bound
    name None on ImportError (:func:`_import_guarded`): one source fix for each module that imports
    a TransformerEngine name unguarded where its code only uses it when TE is there. A row of
    ``upstream_fixes._SOURCE_FIXES`` binds MODULE and NAME (``functools.partial``)."""

    def __init__(self, module: str, name: str):
        self.module, self.name, self.found = module, name, False

    def visit_Module(self, node):
        for index, statement in enumerate(node.body):
            if (isinstance(statement, ast.ImportFrom) and statement.module == self.module
                    and [alias.name for alias in statement.names] == [self.name]):
                node.body[index] = _import_guarded(statement, statement.names[0].asname or self.name)
                self.found = True
        return node


class _BridgeTeImportGuarded(ast.NodeTransformer):
    """A module-level ``import transformer_engine.pytorch as te`` -> the same inside ``try`` with
    ``te = None`` on ImportError, and the module's annotations deferred (``from __future__ import
    annotations``: Bridge's ``TEFusedLoRALinear`` names ``te.ops.Sequential`` in its signatures,
    which Python evaluates at class definition). Upstream's docs send Llama users to Bridge since
    upstream removed its Llama loader (39ec5ebeb4, 2026-05); Bridge 0.5.1 … 0.6.2 and its main
    (067f987) stop at this import without TE, and with it guarded convert and train on the CPU."""

    found = False

    def visit_Module(self, node):
        for index, statement in enumerate(node.body):
            if (isinstance(statement, ast.Import) and len(statement.names) == 1
                    and statement.names[0].name == "transformer_engine.pytorch"
                    and statement.names[0].asname == "te"):
                node.body[index] = _import_guarded(statement, "te")
                self.found = True
        if self.found and not any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
                                  and any(a.name == "annotations" for a in s.names) for s in node.body):
            docstring = int(bool(node.body) and isinstance(node.body[0], ast.Expr)
                            and isinstance(getattr(node.body[0], "value", None), ast.Constant)
                            and isinstance(node.body[0].value.value, str))
            node.body.insert(docstring, ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")],
                                                       level=0))
        return node
