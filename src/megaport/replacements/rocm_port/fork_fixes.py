"""Megatron-DeepSpeed's own bugs in a window of its history that stop a layout on every machine,
ported or not, fixed where the port loads (an after-import step, :mod:`.hooks`) rather than by a
patch in each fork series the window crosses. As :mod:`.upstream_fixes`: each step names the
commits that opened and closed its window, and the baseline gets a fix written apart, as a shim."""

from __future__ import annotations

import ast
import functools

import torch

from .say import say_once
from .upstream_fixes import _replaced_by_fix

_SP_GRADS = ("under DeepSpeed's engine the sequence-parallel weights' gradients are summed over the tensor-parallel "
             "ranks as they are computed (the fork skips Megatron's allreduce_layernorm_grads there)")


def _sequence_parallel_grads_summed_under_deepspeed(module) -> None:
    """Every fork commit with ``--sequence-parallel``, still open: under ``--deepspeed`` the fork skips
    Megatron's optimizer, whose ``allreduce_layernorm_grads`` sums the gradients of the weights marked
    ``sequence_parallel`` (norms, row-parallel biases) over the TP ranks, and DeepSpeed knows no such
    mark: each rank's copy trained on its part of the sequence alone (GPT tp2-sp 3.25 % from one rank
    at 9e72d571). Each marked gradient is all-reduced over the TP group as it is computed; upstream
    trees (no ``deepspeed`` in the module) and runs without the engine are left alone."""
    setup = getattr(module, "setup_model_and_optimizer", None)
    if setup is None or getattr(module, "deepspeed", None) is None or getattr(setup, "__rocm_port_fixed__", False):
        return

    @functools.wraps(setup)
    def setup_model_and_optimizer(*args, **kwargs):
        model, *rest = setup(*args, **kwargs)
        run, mpu = module.get_args(), module.mpu
        if not (getattr(run, "deepspeed", False) and getattr(run, "sequence_parallel", False)
                and mpu.get_tensor_model_parallel_world_size() > 1):
            return (model, *rest)

        def summed(grad):
            grad = grad.clone(memory_format=torch.contiguous_format)
            torch.distributed.all_reduce(grad, group=mpu.get_tensor_model_parallel_group())
            return grad

        for param in model[0].module.parameters():
            if getattr(param, "sequence_parallel", False):
                param.register_hook(summed)
        say_once(_SP_GRADS)
        return (model, *rest)

    setup_model_and_optimizer.__rocm_port_fixed__ = True
    module.setup_model_and_optimizer = setup_model_and_optimizer


_PIPE_TRANSPOSES = ("GPTModelPipe keeps the embedding's [s, b, h] for its layers, as the fork's 53db2b14 does (it "
                    "transposed it again: under pipeline parallelism attention ran over the batch)")


def _as_it_is(hidden):
    return hidden


def _pipe_transposes_once(module) -> None:
    """From the fork's merge of upstream main (9e72d571, 2023-07-04) until its 53db2b14 ("fix pp",
    2023-07-12) the embedding gave [s, b, h] itself, as upstream's does, and GPTModelPipe still
    transposed its output around the layers: under pipeline parallelism every layer attended over the
    batch (with the fusions off the mask's shape refused it). Its transposing steps pass the hidden
    states on as they are, which is what removing them (53db2b14) does; where the embedding gives
    [b, s, h] (before the merge) they are needed and stay."""
    pipe, embedding = getattr(module, "GPTModelPipe", None), getattr(module, "EmbeddingPipe", None)
    forwards = [vars(cls)["forward"] for cls in getattr(embedding, "__mro__", ()) if "forward" in vars(cls)]
    if (pipe is None or getattr(pipe.__init__, "__rocm_port_fixed__", False)
            or not any("transpose" in f.__code__.co_names for f in forwards if hasattr(f, "__code__"))):
        return
    init = pipe.__init__

    def transposing(function) -> bool:
        code = getattr(function, "__code__", None)
        return (getattr(function, "__name__", "") == "<lambda>" and code is not None
                and code.co_filename == module.__file__ and "transpose" in code.co_names)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if any(transposing(f) for f in self.forward_funcs):
            self.forward_funcs = [_as_it_is if transposing(f) else f for f in self.forward_funcs]
            say_once(_PIPE_TRANSPOSES)

    __init__.__rocm_port_fixed__ = True
    pipe.__init__ = __init__


_SAVE_DESTINATION = ("the fork's save hands DeepSpeed a state dict that takes its destination argument, as the fork's "
                     "c11fda71 does (from its 2023-07-04 merge the model's took none: nothing was saved)")


class _StateDictTakingDestination(ast.NodeTransformer):
    """``X.state_dict = X.state_dict_for_save_checkpoint`` -> ``X.state_dict = lambda destination=None,
    prefix='', keep_vars=False: X.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)``:
    the fork's c11fda71, the one statement it changed."""

    found = False

    def visit_Assign(self, node):
        target, value = node.targets[0], node.value
        if (len(node.targets) == 1 and isinstance(target, ast.Attribute) and target.attr == "state_dict"
                and isinstance(value, ast.Attribute) and value.attr == "state_dict_for_save_checkpoint"):
            node.value = ast.copy_location(ast.parse(
                f"lambda destination=None, prefix='', keep_vars=False: "
                f"{ast.unparse(value)}(prefix=prefix, keep_vars=keep_vars)", mode="eval").body, value)
            self.found = True
        return node


def _deepspeed_save_takes_destination(module) -> None:
    """Under ``--deepspeed`` the fork's ``save_checkpoint`` points the model's ``state_dict`` at its
    ``state_dict_for_save_checkpoint`` for DeepSpeed's engine, which calls it with ``destination=``;
    from the fork's merge of upstream main (9e72d571, 2023-07-04) until its c11fda71 (2023-07-11) the
    model's took no such argument, so no checkpoint was written (``TypeError``). Upstream's function
    with the fork's fix (:func:`.upstream_fixes._recompiled`); nothing changes where it is not there."""
    _replaced_by_fix(module, "save_checkpoint", _StateDictTakingDestination(), module, _SAVE_DESTINATION)


_PIPE_PATTERNS = ("GPTModel's universal-checkpoint info takes the parameter patterns GPTModelPipe's does (from the "
                  "fork's 71e8407c until df0e2e42 it asked for methods only GPTModelPipe had: nothing saved at TP > 1)")


def _model_takes_the_pipes_patterns(module) -> None:
    """From the fork's 71e8407c (2023-12-14) until df0e2e42 (2024-03-10) ``GPTModel.universal_checkpoint_info``
    called ``_get_tp_replicated_param_patterns`` and ``_get_row_parallel_param_patterns``, which only
    GPTModelPipe defined: under DeepSpeed's engine without its pipeline no checkpoint was written at
    TP > 1 (``AttributeError``). GPTModel is given GPTModelPipe's, which its vocabulary patterns already
    follow; df0e2e42 rewrote both for universal checkpoints, which the fork did not convert for GPTModel."""
    model, pipe = getattr(module, "GPTModel", None), getattr(module, "GPTModelPipe", None)
    info = getattr(model, "universal_checkpoint_info", None)
    if pipe is None or not hasattr(info, "__code__"):
        return
    missing = [name for name in info.__code__.co_names
               if name.startswith("_get_") and not hasattr(model, name) and name in vars(pipe)]
    for name in missing:
        setattr(model, name, vars(pipe)[name])
    if missing:
        say_once(_PIPE_PATTERNS)


_LOAD_ONLY_WEIGHTS = ("the fork's load_checkpoint takes load_only_weights (False unless asked), as the fork's 38881e2d "
                      "does (from its 2023-07-04 merge it read the name undefined: no checkpoint was loaded)")


class _ParameterItReads(ast.NodeTransformer):
    """``def load_checkpoint(..., strict=True)`` whose body reads ``load_only_weights`` ->
    ``def load_checkpoint(..., strict=True, load_only_weights=False)``: the fork's 38881e2d."""

    found = False

    def visit_FunctionDef(self, node):
        names = {arg.arg for arg in node.args.args + node.args.kwonlyargs}
        if node.name == "load_checkpoint" and "load_only_weights" not in names and any(
                isinstance(n, ast.Name) and n.id == "load_only_weights" for n in ast.walk(node)):
            node.args.args.append(ast.arg(arg="load_only_weights"))
            node.args.defaults.append(ast.Constant(value=False))
            self.found = True
        return node


def _load_takes_load_only_weights(module) -> None:
    """From the fork's merge of upstream main (9e72d571, 2023-07-04) until its 38881e2d (2023-07-11)
    ``load_checkpoint`` read ``load_only_weights``, the parameter the merge had dropped from its
    signature: every resume stopped before its first iteration (``NameError``). Upstream's function
    with the fork's parameter back (:func:`.upstream_fixes._recompiled`)."""
    _replaced_by_fix(module, "load_checkpoint", _ParameterItReads(), module, _LOAD_ONLY_WEIGHTS)
