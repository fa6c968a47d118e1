"""Today's stack (Python 3.12, torch >= 2.6, NumPy 2, transformers 5, DeepSpeed 0.18) for old
upstream code: names those releases removed are restored where missing, and upstream modules
that meet a changed API are fitted right after they load (steps listed in :mod:`.hooks`)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import math
import sys
import types

import torch

from .apex_substitutes import FusedAdam
from .say import say_once

# Upstream code from 2020-2023 uses names that today's torch and NumPy removed: ``torch._six``
# (gone in torch 2.0; clip_grads imports ``inf`` from it) and NumPy's aliases of builtins and
# old spellings (gone in NumPy 1.24/2.0; the indexed dataset's dtype table uses ``np.float``).
# Each is restored, with the meaning it had, only where it is missing, before any module of
# the tree runs: every era then imports and trains on today's stack unchanged.
_NUMPY_REMOVED = {
    "float": "float", "int": "int", "bool": "bool", "object": "object", "str": "str",
    "long": "int", "unicode": "str", "complex": "complex",
    "float_": "float64", "complex_": "complex128", "string_": "bytes_", "unicode_": "str_",
    "product": "prod", "cumproduct": "cumprod", "alltrue": "all", "sometrue": "any",
    "NaN": "nan", "NAN": "nan", "Inf": "inf", "Infinity": "inf", "infty": "inf", "PINF": "inf",
}


def _torch_six() -> types.ModuleType:
    import collections.abc

    six = types.ModuleType("torch._six", "torch._six as torch < 2.0 had it (restored by the ROCm port)")
    six.inf, six.nan = math.inf, math.nan
    six.string_classes, six.int_classes = (str, bytes), int
    six.container_abcs, six.PY3, six.PY37 = collections.abc, True, True
    return six


def _restore_distributed_names() -> list:
    """``torch.distributed.dist_backend`` and ``torch.distributed._backend`` (the default group's
    backend), which 2021 Megatron's DDP reads and torch 2 no longer has."""
    dist = torch.distributed
    if not dist.is_available() or hasattr(dist, "_backend"):
        return []
    if not hasattr(dist, "dist_backend"):
        dist.dist_backend = dist.Backend
    previous = dist.__dict__.get("__getattr__")

    def __getattr__(name):
        if name == "_backend":
            return dist.get_backend() if dist.is_initialized() else "undefined"
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module 'torch.distributed' has no attribute '{name}'")

    dist.__getattr__ = __getattr__
    return ["torch.distributed.dist_backend", "torch.distributed._backend"]


def _restore_typed_storage_untyped() -> list:
    """``TypedStorage._untyped()``, the UntypedStorage under a typed one, as torch 1.x had it (torch
    2.0 renamed it): upstream's distributed optimizer views its grad buffers' bytes through it
    (``torch.tensor(grad_buffer.data.storage()._untyped(), dtype=params_dtype)``) from 2022-09-30
    (fc7f4f035a) until 904b6a2162 (2023-12-01) tried ``untyped_storage()`` first: every
    ``--use-distributed-optimizer`` run of those trees died building the optimizer on torch 2."""
    typed = getattr(torch.storage, "TypedStorage", None)
    if typed is None or hasattr(typed, "_untyped"):
        return []
    typed._untyped = lambda self: self._untyped_storage
    return ["torch.storage.TypedStorage._untyped"]


def install_target_stack_compat() -> list:
    """Restore the removed names above where this stack lacks them; the names restored."""
    import builtins

    restored = []
    if "torch._six" not in sys.modules and importlib.util.find_spec("torch._six") is None:
        sys.modules["torch._six"] = torch._six = _torch_six()
        restored.append("torch._six")
    restored += _restore_distributed_names()
    restored += _restore_typed_storage_untyped()
    try:
        import numpy
    except ImportError:
        return restored
    for name, target in _NUMPY_REMOVED.items():
        if name not in numpy.__dict__:
            value = getattr(builtins, target) if target in {"float", "int", "bool", "object", "str", "complex"} \
                else getattr(numpy, target)
            setattr(numpy, name, value)
            restored.append(f"numpy.{name}")
    return restored


# microsoft/Megatron-DeepSpeed (2022-08 on) imports deepspeed.compression.compress in
# megatron/training.py unconditionally, for --compression-training only; DeepSpeed 0.18 removed its
# compression library (deepspeed.compression is a stub package now). Where it is missing, the
# module is served with both functions refusing --compression-training, and one port line says so.
_DEEPSPEED_COMPRESSION = "deepspeed.compression.compress"


class _RemovedDeepSpeedCompression(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: asked only when DeepSpeed itself has no such module."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == _DEEPSPEED_COMPRESSION else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        def removed(*args, **kwargs):
            raise RuntimeError("--compression-training needs DeepSpeed's compression library, which DeepSpeed "
                               "0.18 removed: install deepspeed<0.18 for it")

        module.init_compression = module.redundancy_clean = removed
        say_once("this DeepSpeed has no compression library (removed in 0.18): "
                 "--compression-training is switched off (it raises); everything else trains as before")


def serve_removed_deepspeed_compression() -> None:
    """Put the finder last on sys.meta_path (once)."""
    if not any(isinstance(f, _RemovedDeepSpeedCompression) for f in sys.meta_path):
        sys.meta_path.append(_RemovedDeepSpeedCompression())


def _both_resize_names(module) -> None:
    """Upstream's inpainting.py of 2022-02 to 2023-09 imports ``resize_`` from vision/utils.py,
    which defines only ``resize``, and then calls ``resize``: an ImportError at import and a
    NameError in forward (upstream's b49249803e later imported ``resize``). Both modules get both
    names; a tree that already has them is left as it is."""
    function = getattr(module, "resize", None) or getattr(module, "resize_", None)
    if function is not None:
        for name in ("resize", "resize_"):
            if not hasattr(module, name):
                setattr(module, name, function)


def _save_planner_takes_coordinator_by_name(module) -> None:
    """Core 0.5 … 0.8's distributed checkpoint saver calls ``planner.set_up_planner(state_dict,
    is_coordinator)`` positionally; torch 2.4 put ``storage_meta`` second, so every rank takes
    itself for a non-coordinator and ``MCoreSavePlanner`` adds the coordinator's sharded objects
    (RNG state, extra states) a second time: saving dies with torch's ``item.index.fqn not in md``.
    As upstream's b972e895a4 (core 0.9) does, a lone positional flag is passed by name; a tree
    that passes it by name, or a torch without ``storage_meta``, is left as it is."""
    planner = getattr(module, "MCoreSavePlanner", None)
    set_up = getattr(planner, "set_up_planner", None)
    if set_up is None or "storage_meta" not in inspect.signature(set_up).parameters:
        return

    @functools.wraps(set_up)
    def set_up_planner(self, state_dict, *args, **kwargs):
        if len(args) == 1 and isinstance(args[0], bool) and "is_coordinator" not in kwargs:
            args, kwargs = (), {**kwargs, "is_coordinator": args[0]}
        return set_up(self, state_dict, *args, **kwargs)

    planner.set_up_planner = set_up_planner


_IOBYTES_ONCE = ("torch's save plan already asks every rank for its byte objects (RNG state, extra states): "
                 "Megatron's planner no longer asks a second time (upstream's f0161d2400)")


def _iobytes_requested_once(module) -> None:
    """Core 0.6 … 0.8's ``MCoreSavePlanner`` (baa76c7e79, 2024-03-13, until f0161d2400, 2024-09-05)
    adds each byte object's write request to a non-coordinator rank's plan, which torch < 2.4 left
    out; today's torch puts them in every rank's plan itself, so each came twice and any save from
    more than one rank (a TP2 or PP2 checkpoint) died in torch's global plan (``item.index.fqn not
    in md``). As f0161d2400 does, each is asked for once: a request the plan already has is not
    added again."""
    planner = getattr(module, "MCoreSavePlanner", None)
    add = getattr(planner, "_add_non_coordinator_iobytes_request", None)
    if add is None or getattr(add, "_rocm_port", False):
        return

    @functools.wraps(add)
    def once(self, plan):
        asked = {item.index for item in plan.items}
        before = len(plan.items)
        add(self, plan)
        added = plan.items[before:]
        kept = [item for item in added if item.index not in asked]
        if len(kept) < len(added):
            say_once(_IOBYTES_ONCE)
            del plan.items[before:]
            plan.items.extend(kept)

    once._rocm_port = True
    planner._add_non_coordinator_iobytes_request = once


def _async_writer_calls_todays_write_item(module) -> None:
    """Core 0.5 … 0.12's asynchronous checkpoint writer calls torch's private ``_write_item`` as
    torch 2.3 had it; torch 2.6 put the writer's stream transforms first and 2.7 added a
    serialization format, so every writer process dies of a TypeError and saving of 'Incomplete
    worker results'. As core 0.13 does, the call gets today's arguments: no transforms (a
    ``_StorageWriterTransforms()`` without extensions) and torch.save's format; a tree that
    passes them itself (core 0.13 on) is left as it is."""
    original = getattr(module, "_write_item", None)
    if original is None:
        return
    try:
        if "serialization_format" in inspect.getsource(module):
            return
    except (OSError, TypeError):
        return
    from torch.distributed.checkpoint import filesystem

    parameters = list(inspect.signature(original).parameters)
    transforms = getattr(filesystem, "_StorageWriterTransforms", None)
    if not (parameters and parameters[0] == "transforms" and transforms) and "serialization_format" not in parameters:
        return

    @functools.wraps(original)
    def _write_item(*args, **kwargs):
        if parameters[0] == "transforms" and transforms and not isinstance(args[0], transforms):
            args = (transforms(), *args)
        if "serialization_format" in parameters and "serialization_format" not in kwargs \
                and len(args) < len(parameters):
            kwargs["serialization_format"] = filesystem.SerializationFormat.TORCH_SAVE
        return original(*args, **kwargs)

    module._write_item = _write_item


class _TorchLoadingItsOwnCheckpoints(types.ModuleType):
    """torch, but ``load`` unpickles whole objects unless told otherwise (torch < 2.6's default)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return torch.load(*args, **kwargs)


def _checkpoints_load_as_they_were_saved(module) -> None:
    """torch 2.6 made ``weights_only=True`` torch.load's default; Megatron's checkpoints (core
    0.5 … 0.9's distributed ones among them) pickle the run's argparse Namespace and more, so
    loading one died of 'Weights only load failed'. As upstream itself later passes
    ``weights_only=False`` for the checkpoints it wrote, the module's ``torch.load`` does so
    unless told otherwise; a module that says ``weights_only`` itself is left as it is."""
    if getattr(module, "torch", None) is not torch or "weights_only" not in inspect.signature(torch.load).parameters:
        return
    try:
        if "weights_only" in inspect.getsource(module):
            return
    except (OSError, TypeError):
        return
    module.torch = _TorchLoadingItsOwnCheckpoints("torch", torch.__doc__)


def _sentinel_tokens_kept(module) -> None:
    """Core 0.14 … 2026-05's HuggingFaceTokenizer reads T5's sentinel tokens back through the
    names transformers lists in ``SPECIAL_TOKENS_ATTRIBUTES``, which no longer holds
    ``additional_special_tokens`` in transformers 5: ``pretrain_t5.py`` dies of an AttributeError
    building its dataset. As upstream's e69a1ea43b does, the tokenizer keeps the list its
    constructor was given and converts that; a tree with that fix is left as it is."""
    cls = getattr(module, "HuggingFaceTokenizer", None)
    ids = getattr(cls, "additional_special_tokens_ids", None) if cls is not None else None
    if not isinstance(ids, property) or "_additional_special_tokens" in ids.fget.__code__.co_names:
        return
    original, signature = cls.__init__, inspect.signature(cls.__init__)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        self._additional_special_tokens = list(bound.arguments.get("additional_special_tokens") or [])
        original(self, *args, **kwargs)

    def additional_special_tokens_ids(self):
        tokens = self._additional_special_tokens or getattr(self.tokenizer, "additional_special_tokens", None) or []
        return self.tokenizer.convert_tokens_to_ids(tokens) if tokens else []

    cls.__init__ = __init__
    cls.additional_special_tokens_ids = property(additional_special_tokens_ids, doc=ids.__doc__)


def _zero_takes_port_fused_adam(module) -> None:
    """DeepSpeed's ZeRO accepts only the optimizer types it lists, apex's FusedAdam among them when
    apex imports; Megatron-DeepSpeed hands it the port's FusedAdam in apex's place: list it too."""
    supported = getattr(module, "ZERO_SUPPORTED_OPTIMIZERS", None)
    if isinstance(supported, list) and FusedAdam not in supported:
        supported.append(FusedAdam)


def legacy_tensor_types(module) -> None:
    """DeepSpeed's CUDA accelerator now gives ``FloatTensor``, ``HalfTensor``... as
    ``functools.partial`` constructors; code written against older DeepSpeed (Megatron-DeepSpeed's
    Float16Module) uses them as types in ``isinstance``. They are torch.cuda's legacy tensor types
    again, which construct tensors as well (what DeepSpeed gave before)."""
    cls = getattr(module, "CUDA_Accelerator", None)
    for name in ("BFloat16Tensor", "ByteTensor", "DoubleTensor", "FloatTensor", "HalfTensor", "IntTensor",
                 "LongTensor"):
        if cls is not None and isinstance(cls.__dict__.get(name), property) and hasattr(torch.cuda, name):
            setattr(cls, name, property(lambda self, _name=name: getattr(torch.cuda, _name)))


def fp16_optimizers_answer_cur_scale(module) -> None:
    """DeepSpeed's fp16 optimizers without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) now
    keep their loss scale in ``loss_scale_config``; Megatron-DeepSpeed before its 3ed9f4f7
    (2023-05) reads ``optimizer.cur_scale``, which they had, finds None and formats it into every
    log line, which raises. ``cur_scale`` is the optimizer's scale again, read and written, as older
    DeepSpeed gave it (ZeRO's optimizers still have it)."""
    if getattr(module, "LossScaleConfig", None) is None:  # an older DeepSpeed: cur_scale is its own
        return
    for name in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        cls = getattr(module, name, None)
        if cls is not None and "cur_scale" not in vars(cls):
            cls.cur_scale = property(lambda self: self.loss_scale_config.cur_scale,
                                     lambda self, value: setattr(self.loss_scale_config, "cur_scale", value))
