"""The yardstick: the unported upstream commit a ported tree came from, as a user without megaport
runs it (its fusions off, none of the series' changes).

It is exported from the tree's own git objects into a temporary folder, so the tree is never
touched. Some eras' unported upstream cannot even start on today's stack without help; there,
and only after a run failed for exactly that reason (:func:`shim_for`), the baseline gets the
smallest shim that lets it start, each listed in the report (:data:`SHIMS`):

- ``transformer-engine``: 2023-07 to 2024-06 import TE layers unguarded. An import stub of
  ``transformer_engine`` that provides nothing: any use of it raises.
- ``stack``: 2020-2023 code uses names today's torch and NumPy removed (``torch._six``,
  ``np.float``). The port's own restoration of those names (rocm_port.py, the one source),
  nothing computational.
- ``apex``: until 2023 Megatron imports apex, ``amp_C`` and the fused layer-norm extension
  unconditionally. What a ROCm apex build would give: the PyTorch stand-ins of rocm_port.py
  (optimizer, multi-tensor ops, layer norm) as ``apex``/``amp_C``/``*_cuda`` modules. The model's
  fusions under test (softmax, bias-GeLU, bias-dropout, gradient accumulation) stay upstream's
  unfused paths.
- ``fused-kernel-build``: until 2023 upstream compiles its CUDA extensions with nvcc at start-up,
  even with the fusions off; the build is skipped (the ``apex`` shim serves the extensions).
- ``wgrad-contiguous``: from 2022-02 upstream views the gradient in its linear layers' backward
  in 2-D, which fails where autograd hands it a non-contiguous one (2022-02 and 2022-05 trees on
  today's torch; upstream made it contiguous itself in 2023-03, 09c2f6e4, and the series carry
  that). The backward gets it contiguous: the same values.
- ``te-spec``: core 0.4-0.5's pretrain_gpt.py builds the TE layer spec whatever
  --transformer-impl says, and its --spec takes no builder; with the TE stub that model cannot be
  built. The TE spec builds Megatron's local layers, as a user without TE would edit it to do (the
  model the port builds there).
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import tempfile

from megaport.git import export_commit

SHIMS = {
    "transformer-engine": "transformer_engine import stub (provides nothing but its LayerNorm/RMSNorm in PyTorch, "
                          "which core 0.4-0.7 build the final norm with whatever the layer spec; any other use raises)",
    "stack": "torch._six and NumPy's removed aliases restored (the port's own restoration; nothing computational)",
    "apex": "apex, amp_C and the layer-norm/wgrad extensions served by the port's PyTorch stand-ins "
            "(what a ROCm apex build gives); the fusions under test stay upstream's unfused paths",
    "fused-kernel-build": "upstream's nvcc build of its CUDA extensions at start-up skipped",
    "te-spec": "the TE GPT layer spec builds Megatron's local layers (core 0.4-0.5's pretrain_gpt.py takes the TE spec "
               "whatever --transformer-impl says and its --spec takes no builder: what a user without TE edits it to "
               "do; the model the port builds)",
    "deepspeed-compression": "DeepSpeed's removed compression module (Megatron-DeepSpeed imports it for "
                             "--compression-training) served as the port serves it: its functions raise",
    "deepspeed-tensor-types": "DeepSpeed's accelerator gives torch.cuda's legacy tensor types for FloatTensor, "
                              "HalfTensor... again (the port's step; Megatron-DeepSpeed uses them in isinstance)",
    "wgrad-contiguous": "the linear layers' backward gets a contiguous gradient before its 2-D view (upstream's "
                        "own 2023-03 fix, which the series carry; the same values)",
    "fork-attention-view": "Megatron-DeepSpeed from 676a482c: CoreAttention gets contiguous query/key/value (its "
                           "views fail on the strided slices of its QKV split on every device; the same values)",
    "fork-deepspeed-train": "Megatron-DeepSpeed 2023-07-04..2023-07-12 (before 636540a9): that commit's own fixes "
                            "for train() with --deepspeed, as after-import steps: DeepSpeed's ZeRO optimizers answer "
                            "scale_loss None, so grad_scale_func stays None (the engine scales the loss); "
                            "get_model_config unwraps the engine; Timers answers .timers (logging only)",
    "fork-legacy-mpu": "Megatron-DeepSpeed 2023-07-04 (before 4278c0a1): the transformer's DeepSpeed recompute "
                       "calls reset_checkpointed_activations_memory_buffer and checkpoint on its mpu (parallel_state, "
                       "which lacks the one and has DeepSpeed's checkpoint, another signature): tensor_parallel's "
                       "two, as 4278c0a1 calls them; every other mpu name stays parallel_state's",
}
_NEEDS = (  # (what a failed run printed, the shim that gets past it), first match wins
    (re.compile(r"No module named '(transformer_engine)|No package metadata was found for transformer.engine"),
     "transformer-engine"),
    (re.compile(r"No module named '(torch\._six)'|module 'numpy' has no attribute"), "stack"),
    (re.compile(r"No module named '(apex|amp_C|fused_\w*_cuda|\w*layer_norm_cuda)|Apex must (currently )?be installed"),
     "apex"),
    (re.compile(r"CUDA_HOME|nvcc|_get_cuda_bare_metal_version|cpp_extension"), "fused-kernel-build"),
    (re.compile(r"megaport baseline stub: TransformerEngine is not installed when instantiating TE"), "te-spec"),
    (re.compile(r"No module named 'deepspeed\.compression\.compress'"), "deepspeed-compression"),
    # Two views that fail the same way, told apart by the line of the traceback that failed.
    (re.compile(r"grad_output = grad_output\.view\((?s:.*)view size is not compatible"), "wgrad-contiguous"),
    (re.compile(r"(query|key|value)_layer = \w+\.view\((?s:.*)view size is not compatible"), "fork-attention-view"),
    (re.compile(r"isinstance\(\) arg 2 must be a type"), "deepspeed-tensor-types"),
    (re.compile(r"'\w*Optimizer\w*' object has no attribute 'scale_loss'|'dict' object has no attribute 'no_sync_func'"
                r"|'Timers' object has no attribute 'timers'"), "fork-deepspeed-train"),
    (re.compile(r"module 'megatron\.core\.parallel_state' has no attribute "
                r"'(?:reset_checkpointed_activations_memory_buffer|checkpoint)'"), "fork-legacy-mpu"),
)
_APEX_MODULES = {  # module -> names it takes from the port's stand-ins
    "amp_C": "from _megaport_standins import amp_C as _m\nglobals().update(vars(_m))\n",
    "fused_mix_prec_layer_norm_cuda": "from _megaport_standins import fused_mix_prec_layer_norm_cuda as _m\n"
                                      "globals().update(vars(_m))\n",
    "fused_layer_norm_cuda": "from _megaport_standins import fused_mix_prec_layer_norm_cuda as _m\n"
                             "globals().update(vars(_m))\n",
    "fused_weight_gradient_mlp_cuda": "from _megaport_standins import fused_weight_gradient_mlp_cuda as _m\n"
                                      "globals().update(vars(_m))\n",
    # The same extension under its 2022 name (apex's fused_dense_cuda), which the wgrad path imports.
    "fused_dense_cuda": "from _megaport_standins import fused_weight_gradient_mlp_cuda as _m\n"
                        "globals().update(vars(_m))\n",
    "apex/__init__": "",
    "apex/optimizers/__init__": "from _megaport_standins import FusedAdam, FusedSGD\n",
    "apex/multi_tensor_apply/__init__": "from _megaport_standins import multi_tensor_applier\n",
    # apex's persistent layer norm (2021-11 imports it unguarded), as torch's layer norm: the same values.
    "apex/contrib/__init__": "",
    "apex/contrib/layer_norm/__init__": "",
    "apex/contrib/layer_norm/layer_norm": "import torch\n\n\nclass FastLayerNormFN:\n    @staticmethod\n"
                                          "    def apply(x, weight, bias, eps):\n"
                                          "        return torch.nn.functional.layer_norm(x, weight.shape, weight, bias, eps)\n",
    "apex/normalization/__init__": "from .fused_layer_norm import FusedLayerNorm, FusedLayerNormAffineFunction, "
                                   "FusedRMSNormAffineFunction\n",
    # apex's FusedLayerNorm module (2021's models build it) has torch's LayerNorm signature and values.
    "apex/normalization/fused_layer_norm": "from _megaport_standins import FusedLayerNormAffineFunction, "
                                           "FusedRMSNormAffineFunction\nfrom torch.nn import LayerNorm as FusedLayerNorm\n",
}
_KERNEL_BUILD_HOOK = '''
from megaport.train.hooks import after_import


def _skip_kernel_build(module):
    """megatron's fused_kernels load* functions do nothing: the extensions come from the apex shim."""
    for name in [n for n in vars(module) if n.startswith("load")]:
        if callable(getattr(module, name)):
            setattr(module, name, lambda *args, **kwargs: None)


for _fused_kernels in ("megatron.fused_kernels", "megatron.legacy.fused_kernels"):
    after_import(_fused_kernels, _skip_kernel_build)
'''

# apex's RMSNorm module, which Megatron-DeepSpeed imports from apex.normalization on 'cuda' (2023-12
# on): torch's RMSNorm with apex's signature, appended to the apex shim's apex.normalization.
_APEX_RMSNORM = """

import torch as _torch


class MixedFusedRMSNorm(_torch.nn.RMSNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, **kwargs):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)


FusedRMSNorm = MixedFusedRMSNorm
"""
# What the apex shim's modules also hold: apex's own __init__ imports its optimizers and
# normalization (DeepSpeed's ZeRO lists apex.optimizers.FusedAdam when `import apex` has it).
_APEX_ADDED = {"apex/__init__": "from . import optimizers, normalization\n",
               "apex/normalization/__init__": _APEX_RMSNORM}
_TE_SPEC_HOOK = '''
from megaport.train.hooks import after_import


def _local_spec_for_te_spec(module):
    module.get_gpt_layer_with_transformer_engine_spec = module.get_gpt_layer_local_spec


after_import("megatron.core.models.gpt.gpt_layer_specs", _local_spec_for_te_spec)
'''
_FORK_ATTENTION_HOOK = '''
from megaport.train.hooks import after_import


def _contiguous_core_attention(module):
    """CoreAttention.forward gets contiguous query, key and value: the same values, in a layout
    its views accept."""
    forward = module.CoreAttention.forward

    def contiguous_forward(self, query_layer, key_layer, value_layer, *args, **kwargs):
        return forward(self, query_layer.contiguous(), key_layer.contiguous(), value_layer.contiguous(),
                       *args, **kwargs)

    module.CoreAttention.forward = contiguous_forward


after_import("megatron.model.transformer", _contiguous_core_attention)
'''

_WGRAD_CONTIGUOUS_HOOK = '''
from megaport.train.hooks import after_import


def _contiguous_wgrad_gradient(module):
    """The linear layers' backward gets a contiguous gradient: the same values, in a layout its
    2-D view accepts."""
    function = module.LinearWithGradAccumulationAndAsyncAllreduce
    backward = function.backward

    def contiguous_backward(ctx, grad_output, *args):
        return backward(ctx, grad_output.contiguous(), *args)

    function.backward = staticmethod(contiguous_backward)


after_import("megatron.mpu.layers", _contiguous_wgrad_gradient)
'''


def _legacy_tensor_types_source(port_source: str) -> str:
    """The port's step restoring DeepSpeed's legacy tensor types, run after its accelerator loads."""
    tree = ast.parse(port_source)
    step = next(node for node in tree.body if getattr(node, "name", None) == "legacy_tensor_types")
    return ("import torch\nfrom megaport.train.hooks import after_import\n\n\n"
            + ast.get_source_segment(port_source, step)
            + "\n\n\nafter_import('deepspeed.accelerator.cuda_accelerator', legacy_tensor_types)\n")


def _deepspeed_compression_source(port_source: str) -> str:
    """The port's serving of DeepSpeed's removed compression module, from rocm_port.py's source."""
    tree = ast.parse(port_source)
    wanted = {"_DEEPSPEED_COMPRESSION", "_RemovedDeepSpeedCompression", "_SAID", "say_once",
              "serve_removed_deepspeed_compression"}
    parts = [ast.get_source_segment(port_source, node) for node in tree.body
             if getattr(node, "name", None) in wanted
             or any(getattr(t, "id", None) in wanted for t in getattr(node, "targets", []))]
    return "import importlib.abc\nimport os\n\n" + "\n\n".join(parts) + "\n\n\nserve_removed_deepspeed_compression()\n"


_TE_STUB_SOURCE = '''"""Import stub of TransformerEngine for megaport's baseline run: it provides nothing.

Upstream of 2023-07 to 2024-06 imports TE layers at module level, unguarded, even when the run
uses --transformer-impl local. Every name here is a placeholder class: subclassing it at import
works, and any use (calling, instantiating, reading an attribute) raises; but LayerNorm and
RMSNorm, which core 0.4-0.7 build the final norm with whatever the layer spec, are torch's.
"""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise ImportError("transformer_engine is a megaport baseline stub: TransformerEngine is not installed")

    def __init_subclass__(cls, **kwargs):
        pass


class _Namespace:
    def __init__(self, name):
        self.__name__ = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (_Unavailable,), {"__module__": self.__name__})
        return _Namespace(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise ImportError("transformer_engine is a megaport baseline stub: TransformerEngine is not installed")


def _norm(kind):
    import torch

    class Norm(getattr(torch.nn, kind)):
        """TE's norm signature over torch's: what core 0.4-0.7's TENorm builds the final norm with."""

        def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, zero_centered_gamma=False,
                     params_dtype=None, device=None, **kwargs):
            if zero_centered_gamma:
                raise ImportError("transformer_engine stub: zero_centered_gamma needs TransformerEngine")
            super().__init__(hidden_size, eps=eps, dtype=params_dtype, device=device)

    Norm.__name__ = Norm.__qualname__ = kind
    return Norm


class _PyTorch(_Namespace):
    def __getattr__(self, name):
        if name in ("LayerNorm", "RMSNorm"):
            return _norm(name)
        return super().__getattr__(name)


pytorch = _PyTorch("transformer_engine.pytorch")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_Namespace("transformer_engine"), name)
'''


@contextlib.contextmanager
def unported_upstream(tree, sha: str):
    """The commit ``sha`` of ``tree``'s history exported to a temporary folder, and an environment
    without the tree's PYTHONPATH: ``(folder, env)``."""
    with tempfile.TemporaryDirectory(prefix="megaport-upstream-") as folder:
        export_commit(tree, sha, folder)
        yield folder, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def shim_for(failure: str, have: list) -> str | None:
    """The shim that gets past this failure (the first that matches and is not in ``have``)."""
    for pattern, shim in _NEEDS:
        if shim not in have and pattern.search(failure):
            return shim
    return None


def _write(folder: str, module: str, text: str) -> None:
    path = os.path.join(folder, module + ".py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _stack_source(port_source: str) -> str:
    """The port's restoration of removed names, taken from rocm_port.py's own source (one source):
    its table and functions, then the call."""
    tree = ast.parse(port_source)
    wanted = {"_NUMPY_REMOVED", "_torch_six", "_restore_distributed_names", "install_target_stack_compat"}
    parts = [ast.get_source_segment(port_source, node) for node in tree.body
             if getattr(node, "name", None) in wanted
             or any(getattr(t, "id", None) in wanted for t in getattr(node, "targets", []))]
    return "\n\n".join(parts) + "\n\n\ninstall_target_stack_compat()\n"


def write_shims(folder: str, shims: list) -> None:
    """The shims into ``folder``: modules and packages, and one ``sitecustomize`` that Python runs
    at start-up for what must happen before upstream's first import."""
    from megaport.replacements import render

    port = render(fully_masked_rows_are_zero=True)
    startup = ["import importlib.util", "import math", "import sys", "import types", ""]
    if "transformer-engine" in shims:
        _write(folder, "transformer_engine/__init__", _TE_STUB_SOURCE)
        # Upstream asks importlib.metadata for TE's version at import; the stub claims none.
        info = os.path.join(folder, "transformer_engine-0.0.0+megaport.stub.dist-info")
        os.makedirs(info, exist_ok=True)
        with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
            f.write("Metadata-Version: 2.1\nName: transformer-engine\nVersion: 0.0.0+megaport.stub\n")
    if "stack" in shims:
        startup += ["import torch", "", _stack_source(port)]
    if "apex" in shims:
        # The port's module, minus its import blocker (which refuses apex) and its restoration of
        # removed names (the "stack" shim, added only where the run needs it).
        standins = port.replace("\ninstall_import_blocker()\n", "\n").replace("\ninstall_target_stack_compat()\n", "\n")
        # ... and its serving of DeepSpeed's removed compression module (the "deepspeed-compression" shim).
        standins = standins.replace("\nserve_removed_deepspeed_compression()\n", "\n")
        _write(folder, "_megaport_standins", standins)
        for module, text in _APEX_MODULES.items():
            _write(folder, module, text + _APEX_ADDED.get(module, ""))
    if "fused-kernel-build" in shims:
        startup.append(_KERNEL_BUILD_HOOK)
    if "deepspeed-compression" in shims:
        startup.append(_deepspeed_compression_source(port))
    if "deepspeed-tensor-types" in shims:
        startup.append(_legacy_tensor_types_source(port))
    if "fork-attention-view" in shims:
        startup.append(_FORK_ATTENTION_HOOK)
    if "wgrad-contiguous" in shims:
        startup.append(_WGRAD_CONTIGUOUS_HOOK)
    if "te-spec" in shims:
        startup.append(_TE_SPEC_HOOK)
    if "fork-deepspeed-train" in shims:
        startup.append(_FORK_DEEPSPEED_TRAIN_HOOK)
    if "fork-legacy-mpu" in shims:
        startup.append(_FORK_LEGACY_MPU_HOOK)
    _write(folder, "sitecustomize", "\n".join(startup) + "\n")


def with_shims(env: dict, folder: str, shims: list) -> dict:
    """``env`` with the ``shims`` written into ``folder`` first on PYTHONPATH."""
    write_shims(folder, shims)
    paths = [folder] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def with_fewest_shims(start, env: dict, *, attempts: int = 8) -> tuple:
    """``start(env)`` on an unported upstream, retried with one more shim each time it fails for a
    shim's reason: (its result, the shims it needed). Any other failure is raised as it is."""
    shims: list = []
    with tempfile.TemporaryDirectory(prefix="megaport-shims-") as shim_dir:
        for _ in range(attempts):
            try:
                return start(with_shims(env, shim_dir, shims) if shims else env), shims
            except RuntimeError as exc:
                needed = shim_for(str(exc), shims)
                if needed is None:
                    raise
                shims.append(needed)
    raise RuntimeError(f"the unported upstream did not start even with the shims {shims}")


def run_unported(run, sha: str) -> tuple[dict, list]:
    """``run`` (a pretrain.Run on a ported tree) on the tree's unported upstream commit ``sha``, as
    given (its mode, sizes and dropout): (the result, the shims it needed, listed in the result)."""
    import dataclasses

    from megaport.train.pretrain import run_pretrain

    with unported_upstream(run.tree, sha) as (folder, env):
        upstream = dataclasses.replace(run, tree=folder)
        result, shims = with_fewest_shims(lambda shimmed: run_pretrain(upstream, shimmed), env)
    result["baseline_shims"] = [SHIMS[s] for s in shims]
    return result, shims


# Megatron-DeepSpeed's merge of upstream (9e72d571, 2023-07-04) until 636540a9 (2023-07-12): the
# fork's own fixes of 636540a9, which the series before it carry as a patch, as after-import steps.
_FORK_DEEPSPEED_TRAIN_HOOK = '''
from megaport.train.hooks import after_import


def _no_scale_loss(module):
    """DeepSpeed's ZeRO optimizers answer scale_loss None: the fork's train() then leaves
    grad_scale_func None, as 636540a9 does under --deepspeed (the engine scales the loss)."""
    if hasattr(module, "ZeROOptimizer"):
        module.ZeROOptimizer.scale_loss = None


def _engine_model_config(module):
    """get_model_config unwraps DeepSpeed's engine under --deepspeed (636540a9's lines): the
    engine's own `config` is its config dict, not the model's TransformerConfig."""
    def get_model_config(model):
        from megatron import get_args

        if get_args().deepspeed:
            return module.get_attr_wrapped_model(model.module, "config", allow_none=False)
        return module.get_attr_wrapped_model(model, "config", allow_none=False)

    module.get_model_config = get_model_config


def _timers_by_name(module):
    """Timers answers .timers (its _timers), which the fork's training_log reads: logging only."""
    module.Timers.timers = property(lambda self: self._timers)


after_import("deepspeed.runtime.base_optimizer", _no_scale_loss)
after_import("megatron.core.utils", _engine_model_config)
after_import("megatron.timers", _timers_by_name)
'''
# Megatron-DeepSpeed 9e72d571 (before 4278c0a1): its DeepSpeed recompute calls tensor_parallel's
# checkpointing on mpu, which is parallel_state there (whose `checkpoint` initialize.py makes
# DeepSpeed's, another signature). Stepped in after megatron.model, which imports the transformer:
# fork-attention-view (2024-12 on) steps into megatron.model.transformer itself.
_FORK_LEGACY_MPU_HOOK = '''
from megaport.train.hooks import after_import


def _legacy_mpu_in_transformer(package):
    """transformer.py's mpu is parallel_state but for the two checkpointing functions its DeepSpeed
    recompute calls on it: tensor_parallel's, the ones 4278c0a1 calls."""
    import importlib

    from megatron.core import parallel_state, tensor_parallel

    transformer = importlib.import_module("megatron.model.transformer")

    class LegacyMpu:
        reset_checkpointed_activations_memory_buffer = staticmethod(
            tensor_parallel.reset_checkpointed_activations_memory_buffer)
        checkpoint = staticmethod(tensor_parallel.checkpoint)

        def __getattr__(self, name):
            return getattr(parallel_state, name)

    transformer.mpu = LegacyMpu()


after_import("megatron.model", _legacy_mpu_in_transformer)
'''
