"""Upstream's own bugs in a window of its history that stop a layout or a model family on every
machine, ported or not, fixed where the port loads anyway (an after-import step, :mod:`.hooks`), so
one fix reaches every commit of the window whatever series ports it. Each step names the commits
that opened and closed its window; the unported baseline gets the same fix, written apart, as a
listed shim."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math

import torch

from .say import say_once
from .te_absent import _BRIDGE_LORA, _BridgeTeImportGuarded, _ImportFromGuarded

_NO_RANKS = ("parallel_state asked for a process group of no ranks (upstream 9208adbdc7 ... e43abe7dfa, context "
             "parallelism > 1): none is made, every rank is outside it, as upstream's fix stopped asking for it")


def _ranks_of(args, kwargs):
    return kwargs["ranks"] if "ranks" in kwargs else (args[0] if args else None)


def _no_group_of_no_ranks(module) -> None:
    """Upstream from 9208adbdc7 (2024-03-27) until e43abe7dfa reached main (2024-04-12; core 0.6.0
    has it): with context parallelism > 1, ``initialize_model_parallel`` builds expert groups as
    ``range(start + k, end, tp * cp)`` for every ``k < tp * cp``, and the ranges for ``k >= tp`` are
    empty. torch takes an empty rank list for the default group and fails to build it
    (``TypeError: ProcessGroup(store, None, 0)``), so CP2 never started. A group of no ranks has no
    member: each rank is told it is outside (torch's ``GroupMember.NON_GROUP_MEMBER``) and nothing
    is communicated, which at EP 1 gives exactly the groups of upstream's fix."""
    initialize = getattr(module, "initialize_model_parallel", None)
    if initialize is None or getattr(initialize, "__rocm_port_no_empty_groups__", False):
        return
    dist = torch.distributed

    @functools.wraps(initialize)
    def initialize_model_parallel(*args, **kwargs):
        new_group = dist.new_group

        def new_group_unless_empty(*group_args, **group_kwargs):
            ranks = _ranks_of(group_args, group_kwargs)
            if ranks is not None and len(ranks) == 0:
                say_once(_NO_RANKS)
                return dist.GroupMember.NON_GROUP_MEMBER
            return new_group(*group_args, **group_kwargs)

        dist.new_group = new_group_unless_empty
        try:
            return initialize(*args, **kwargs)
        finally:
            dist.new_group = new_group

    initialize_model_parallel.__rocm_port_no_empty_groups__ = True
    module.initialize_model_parallel = initialize_model_parallel


_GATHERED = ("--overlap-param-gather: the weights other ranks updated are gathered before the checkpoint is "
             "written (upstream's ac08742c96; the checkpoint held them one step old)")


def _optimizers_with_pending_gather(optimizer) -> list:
    """The distributed optimizers in ``optimizer`` (itself, or a chained one's) whose forward
    pre-hook still has to gather the weights the other data-parallel ranks updated."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o for o in inner if getattr(o, "remove_pre_hook_handle", None) is not None
            and callable(getattr(o, "disable_pre_hook", None)) and callable(getattr(o, "enable_pre_hook", None))]


def _weights_gathered_before_save(module) -> None:
    """Upstream from 3b417268a2 (2023-11-17) until ac08742c96 reached main (2024-05-04; core 0.6
    and 0.7.0 have it): with ``--overlap-param-gather`` the distributed optimizer gathers the
    weights each data-parallel rank updated in the next forward's pre-hook, and ``save_checkpoint``
    ran before that: the checkpoint held each rank's own shard updated and the rest one step old,
    so a resumed run left the uninterrupted one at its first iteration (main 2024-04, Llama, DP2:
    grad norm 14 % apart there). As ac08742c96 does around the save, the gather completes first
    (``disable_pre_hook``) and the hook is put back after; where upstream already did so, no hook
    is pending and nothing changes."""
    save = getattr(module, "save_checkpoint", None)
    if save is None or getattr(save, "__rocm_port_gathered__", False):
        return

    @functools.wraps(save)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        pending = _optimizers_with_pending_gather(optimizer)
        if pending:
            say_once(_GATHERED)
        for one in pending:
            one.disable_pre_hook()
        try:
            return save(iteration, model, optimizer, *args, **kwargs)
        finally:
            for one in pending:
                one.enable_pre_hook()

    save_checkpoint.__rocm_port_gathered__ = True
    module.save_checkpoint = save_checkpoint


_RANK_IN_LOG = ("save_checkpoint logs rank 0 where no process group is initialized (upstream's converter saves "
               "without one), as upstream's 26c3d085b4 does; it asked for the rank and stopped after the first")


class _RankOfNoGroupIsZero(ast.NodeTransformer):
    """``torch.distributed.get_rank()`` inside an f-string -> ``(get_rank() if is_initialized() else 0)``:
    26c3d085b4's change (its other calls are guarded already); ``found`` says whether one was there."""

    found = False
    _in_fstring = 0

    def visit_JoinedStr(self, node):
        self._in_fstring += 1
        self.generic_visit(node)
        self._in_fstring -= 1
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if not (self._in_fstring and not node.args and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get_rank" and ast.unparse(node.func.value) == "torch.distributed"):
            return node
        self.found = True
        initialized = ast.parse("torch.distributed.is_initialized()", mode="eval").body
        return ast.copy_location(ast.IfExp(test=initialized, body=node, orelse=ast.Constant(0)), node)


def _rank_logged_without_a_group(module) -> None:
    """Main 0bc3547702 (2024-07-01) until 26c3d085b4 (2024-07-10): ``save_checkpoint`` logged
    ``torch.distributed.get_rank()`` unguarded after writing a rank's files, and upstream's own
    checkpoint converter saves with no process group: it wrote tensor-parallel rank 0 and stopped
    (``ValueError``; a TP2 conversion of Hugging Face weights loaded nothing, e6-2024-06's range).
    Upstream's function with 26c3d085b4's guard (:func:`_recompiled`); it runs before the gather step
    wraps the function. Training always has a process group, so the unported baseline, which
    converts nothing, needs no shim."""
    _replaced_by_fix(module, "save_checkpoint", _RankOfNoGroupIsZero(), module, _RANK_IN_LOG)


_NORM_FLAG = ("--apply-layernorm-1p left upstream's parser but its legacy model still read it: an argument the parser "
              "no longer has is off, as upstream's 01b361c9cf reads it")


def _norm_without_the_removed_flag(module) -> None:
    """Upstream from 639c08ab82 (main 2026-01-29; the core 0.16.1 and 0.17.0 releases have it) until
    01b361c9cf (2026-02-20): ``--apply-layernorm-1p`` left the parser (its arguments now generated
    from TransformerConfig), but the legacy model's ``get_norm`` still read it, so every legacy GPT
    with RMSNorm failed ``AttributeError: 'Namespace' object has no attribute 'apply_layernorm_1p'``:
    what upstream's checkpoint converter builds to bring Llama and Mixtral weights in. As
    01b361c9cf reads it, an argument the parser no longer has is off, for the call alone."""
    get_norm, get_args = getattr(module, "get_norm", None), getattr(module, "get_args", None)
    if get_norm is None or get_args is None or getattr(get_norm, "__rocm_port_flag_off__", False):
        return

    @functools.wraps(get_norm)
    def served(config, *args, **kwargs):
        namespace = get_args()
        if "apply_layernorm_1p" in vars(namespace):
            return get_norm(config, *args, **kwargs)
        say_once(_NORM_FLAG)
        namespace.apply_layernorm_1p = False
        try:
            return get_norm(config, *args, **kwargs)
        finally:
            del namespace.apply_layernorm_1p

    served.__rocm_port_flag_off__ = True
    module.get_norm = served


_ONE_NORM = ("the expert and the dense optimizers clip their gradients by one norm, that of all the model's "
             "gradients, experts on every expert-parallel rank included (upstream's ddfcc589c0; each clipped by "
             "its own before)")


def _is_expert_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` (one of a chain) holds the expert-parallel parameters: its param groups
    say so (``is_expert_parallel``, every era of the chain), or its parameters are not all-reduced."""
    groups = getattr(getattr(optimizer, "optimizer", None), "param_groups", None) or []
    if any(g.get("is_expert_parallel") for g in groups):
        return True
    return any(not getattr(p, "allreduce", True) for g in groups for p in g.get("params", ()))


def _main_grads_ready(optimizer) -> float:
    """Put ``optimizer``'s main gradients where its own step would (what it copies is copied again
    there, so nothing changes) and answer the factor that unscales them (fp16's loss scale)."""
    copy = getattr(optimizer, "_copy_model_grads_to_main_grads", None)
    if callable(copy):
        copy()
    else:  # FP32Optimizer: the gradients the data-parallel buffer holds
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                if getattr(param, "main_grad", None) is not None:
                    param.grad = param.main_grad
    scaler = getattr(optimizer, "grad_scaler", None)
    return float(scaler.inv_scale.item()) if scaler is not None else 1.0


def _norm_squared(optimizer, device) -> torch.Tensor:
    """The squared 2-norm of ``optimizer``'s part of the model's gradients, over every rank that
    holds a piece of it: its own model-parallel group (the whole world for a distributed optimizer),
    and for the experts, when that group leaves them out, the expert-parallel ranks too."""
    from megatron.core import parallel_state

    unscale = _main_grads_ready(optimizer)
    grads = optimizer.get_main_grads_for_grad_norm()
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for grad in grads:
        total += grad.detach().float().norm().to(device) ** 2
    total *= unscale * unscale
    group = optimizer.get_model_parallel_group()
    if group is None or not _is_expert_optimizer(optimizer):
        torch.distributed.all_reduce(total, group=group)
    elif hasattr(parallel_state, "get_expert_model_parallel_group"):
        torch.distributed.all_reduce(total, group=group)
        torch.distributed.all_reduce(total, group=parallel_state.get_expert_model_parallel_group())
    else:  # core 0.5 names no expert group alone: tensor x expert ranks, then the pipeline's
        torch.distributed.all_reduce(total, group=parallel_state.get_tensor_and_expert_parallel_group())
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


def _reduction_device():
    """Where upstream reduces its norms: the current GPU (megaport's CPU launcher answers the CPU)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def _chained_optimizers_clip_by_one_norm(module) -> None:
    """Upstream from d657a3ef5c (2024-01-17: the expert parameters get their own optimizer, chained
    with the dense one) until ddfcc589c0 (2024-05-30, "Fix dual-optimizer gradient clipping
    issue"): ``ChainedOptimizer.step`` stepped each optimizer whole, so each clipped its gradients by
    its own norm, the experts' counted on this expert-parallel rank alone. With expert parallelism
    a Mixtral run left one rank wherever the norm passed ``--clip-grad`` (main 2024-03, EP2: grad norm
    12 % apart by iteration 29, the loss 0.3 %; EP1 builds one optimizer and clips right). As
    ddfcc589c0 does, the total over every optimizer (experts reduced over the expert-parallel ranks
    too) is computed once, every optimizer clips by it, and the chain reports it; where the total is
    not finite (fp16 overflow in one of them) each clips as before."""
    chained = getattr(module, "ChainedOptimizer", None)
    if chained is None or hasattr(chained, "prepare_grads") or getattr(chained.step, "__rocm_port_one_norm__", False):
        return
    step = chained.step

    @functools.wraps(step)
    def step_clipping_by_one_norm(self, *args, **kwargs):
        inner = list(self.chained_optimizers)
        if len(inner) < 2:
            return step(self, *args, **kwargs)
        said = {}

        def total_norm():
            if "total" not in said:
                squared = sum(_norm_squared(o, _reduction_device()) for o in inner)
                said["total"] = float(squared.sqrt().item())
            return said["total"]

        def clip_by_total(optimizer, own):
            def clip_grad_norm(clip_grad, *rest, **kw):
                total = total_norm()
                if not math.isfinite(total):
                    return own(clip_grad, *rest, **kw)
                say_once(_ONE_NORM)
                coefficient = float(clip_grad) / (total + 1.0e-6)
                if coefficient < 1.0:
                    for param in optimizer.get_parameters():
                        if param.grad is not None:
                            param.grad.detach().mul_(coefficient)
                return total
            return clip_grad_norm

        for optimizer in inner:
            optimizer.clip_grad_norm = clip_by_total(optimizer, optimizer.clip_grad_norm)
        try:
            successful, grad_norm, zeros = step(self, *args, **kwargs)
        finally:
            for optimizer in inner:
                del optimizer.clip_grad_norm
        if "total" in said and grad_norm and math.isfinite(said["total"]):
            grad_norm = said["total"]
        return successful, grad_norm, zeros

    step_clipping_by_one_norm.__rocm_port_one_norm__ = True
    chained.step = step_clipping_by_one_norm


def _parsed_at_its_lines(source: str, first: int) -> ast.Module:
    """A function's source parsed at its lines in the file; an indented one (a method) inside a
    stand-in class, as ``textwrap.dedent`` leaves it indented where a continuation line is indented
    with tabs (core's LinearWithGradAccumulationAndAsyncCommunication.backward in 23.04 and 23.06)."""
    if not source[:1].isspace():
        tree = ast.parse(source)
        ast.increment_lineno(tree, first - 1)
        return tree
    enclosing = ast.parse("class _Enclosing:\n" + source).body[0]
    tree = ast.Module(body=enclosing.body, type_ignores=[])
    ast.increment_lineno(tree, first - 2)
    return tree


def _recompiled(function, fix, module):
    """``function`` compiled again from its syntax tree as ``fix`` (a NodeTransformer with ``found``)
    changes it, in ``module``'s globals, under its own file and lines; None where ``fix`` finds nothing,
    the source is not on disk, or it has a closure (zero-argument ``super()`` needs its class)."""
    if inspect.unwrap(function).__code__.co_freevars:  # a decorator's wrapper (custom_bwd) is compiled again with it
        return None
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    tree = fix.visit(_parsed_at_its_lines("".join(lines), first))
    if not fix.found:
        return None
    ast.fix_missing_locations(tree)
    made: dict = {}
    exec(compile(tree, inspect.getsourcefile(function), "exec"), vars(module), made)  # upstream's own code
    fixed = made[function.__name__]
    if isinstance(fixed, (staticmethod, classmethod)):  # its decorators ran again on the fixed function
        return fixed
    return functools.wraps(function)(fixed)


def _replaced_by_fix(owner, name: str, fix, module, said: str) -> None:
    """``owner.name``, upstream's function, replaced by itself compiled again as ``fix`` changes it
    (:func:`_recompiled`), said once; left alone where it is absent, already fixed, or unchanged by ``fix``."""
    function = getattr(owner, name, None)
    if function is None or getattr(function, "__rocm_port_fixed__", False):
        return
    fixed = _recompiled(function, fix, module)
    if fixed is None:
        return
    fixed.__rocm_port_fixed__ = True
    setattr(owner, name, fixed)
    say_once(said)


_T5_LABELS = ("T5's dataset zeroes the pad tokens of its decoder output, as upstream's 9ddbce3aa2 does (it named "
              "a loop variable, 'labels', and failed on a sample without masked spans)")


class _DecoderOutputForLabels(ast.NodeTransformer):
    """``labels[labels == X] = 0`` -> ``decoder_output[decoder_output == X] = 0``: upstream's
    9ddbce3aa2, the one statement it changed; ``found`` says whether the statement was there."""

    found = False

    def visit_Assign(self, node):
        target = node.targets[0] if len(node.targets) == 1 else None
        if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == "labels"
                and isinstance(target.slice, ast.Compare) and isinstance(target.slice.left, ast.Name)
                and target.slice.left.id == "labels"):
            target.value.id = target.slice.left.id = "decoder_output"
            self.found = True
        return node


def _t5_decoder_output_pads_zeroed(module) -> None:
    """Main 75c07217d1 (2025-10-29) until 9ddbce3aa2 (2026-02-09; core 0.16 has the fix):
    ``T5MaskedWordPieceDataset.__getitem__`` zeroes the pads of ``labels``, its masked spans' loop
    variable, not of the decoder output: a sample without masked spans fails (``UnboundLocalError``,
    T5 stopped at iteration 17 on a 2025-11 commit). Three months of main inside series whose other
    commits lack the line, so no series patch can carry it: upstream's method with 9ddbce3aa2's one
    statement (:func:`_recompiled`); where the statement is absent, nothing changes."""
    _replaced_by_fix(getattr(module, "T5MaskedWordPieceDataset", None), "__getitem__", _DecoderOutputForLabels(),
                     module, _T5_LABELS)


_MOE_SPEC_USE_TE = ("the local GPT spec's MoE layer is built of local layers, as upstream's 37cd8f280d has it (the spec "
                    "asked for TransformerEngine's whatever it was given: NameError without TE)")


class _MoESpecTakesUseTe(ast.NodeTransformer):
    """``_get_moe_module_spec(use_te=True, ...)`` -> ``use_te=use_te`` where ``use_te`` is given: 37cd8f280d."""

    found = False

    def visit_FunctionDef(self, node):
        if any(a.arg == "use_te" for a in node.args.args + node.args.kwonlyargs):
            self.generic_visit(node)
        return node

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "_get_moe_module_spec":
            for keyword in node.keywords:
                if keyword.arg == "use_te" and isinstance(keyword.value, ast.Constant) and keyword.value.value is True:
                    keyword.value = ast.copy_location(ast.Name(id="use_te", ctx=ast.Load()), keyword.value)
                    self.found = True
        return self.generic_visit(node)


def _local_moe_spec_takes_use_te(module) -> None:
    """Main 60d5b383fa (2024-12-07) until 37cd8f280d (2024-12-09): ``_get_mlp_module_spec`` passed
    ``use_te=True`` to ``_get_moe_module_spec`` whatever it was given: without TE Mixtral and DeepSeek
    failed to build (``NameError: name 'TEColumnParallelGroupedLinear' is not defined``). Two days of
    main, so no series patch can carry it: upstream's function with 37cd8f280d's one argument."""
    _replaced_by_fix(module, "_get_mlp_module_spec", _MoESpecTakesUseTe(), module, _MOE_SPEC_USE_TE)


_DTYPES_MAPPED_ONCE = ("arguments validated once validate again, as upstream's 4d4621ba08 has it (the optimizer's dtype "
                       "flags were mapped from their names whatever they held: the converter's saver failed with "
                       "KeyError: torch.float32)")


class _DtypeMappedOnce(ast.NodeTransformer):
    """``dtype_map[args.X]`` -> ``args.X if isinstance(args.X, torch.dtype) else dtype_map[args.X]``:
    upstream's 4d4621ba08 (its ``map_dtype``), each subscript it changed."""

    found = False

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if not (isinstance(node.value, ast.Name) and node.value.id == "dtype_map" and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Attribute)):
            return node
        self.found = True
        is_dtype = ast.Call(func=ast.Name(id="isinstance", ctx=ast.Load()),
                            args=[node.slice, ast.Attribute(value=ast.Name(id="torch", ctx=ast.Load()), attr="dtype",
                                                            ctx=ast.Load())], keywords=[])
        return ast.copy_location(ast.IfExp(test=is_dtype, body=node.slice, orelse=node), node)


def _arguments_validate_twice(module) -> None:
    """Main ca87dcd697 (2024-12-19) until 4d4621ba08 (2025-01-31): ``validate_args`` mapped
    ``--main-grads-dtype`` and the other optimizer dtype flags through ``dtype_map[name]``, so
    arguments already validated (a checkpoint's, which the converter's saver takes from its loader
    and validates again) failed with ``KeyError: torch.float32``: no conversion wrote a checkpoint,
    on any machine. Six weeks of main across core-0.10 and core-0.11, whose release trees lack the
    line, so no series patch can carry it: upstream's function with 4d4621ba08's mapping
    (:func:`_recompiled`); where no ``dtype_map[...]`` is read, nothing changes."""
    _replaced_by_fix(module, "validate_args", _DtypeMappedOnce(), module, _DTYPES_MAPPED_ONCE)


_TE_IMPORT_GUARDED = ("language_module imports TransformerEngine's parallel cross entropy where TE is installed, as "
                      "upstream's 028729b9bc does (its unguarded import stopped every model without TE)")


_PROJECTOR_TE_IMPORT = ("the multimodal projector imports TransformerEngine's checkpoint where TE is installed (the "
                        "nano-v3-vl snapshot imports it unguarded, from megatron.training's tokenizer, and never calls "
                        "it: its use_te is False)")


_DEPRECATED_MOVED = ("the MoE experts import upstream's deprecation decorator from megatron.core.utils, as upstream's "
                     "4bdd7b10e6 does (5f5741db9b imported it from a module that never existed: megatron.core "
                     "imported nowhere)")


class _ImportFromMoved(ast.NodeTransformer):
    """A module-level ``from OLD import NAME`` -> ``from NEW import NAME``: a name upstream imported
    from a module it never had, where upstream's fix imports it from where it is. A row of
    :data:`_SOURCE_FIXES` binds OLD, NAME and NEW (``functools.partial``)."""

    def __init__(self, old: str, name: str, new: str):
        self.old, self.name, self.new, self.found = old, name, new, False

    def visit_Module(self, node):
        for statement in node.body:
            if (isinstance(statement, ast.ImportFrom) and statement.module == self.old and statement.level == 0
                    and [alias.name for alias in statement.names] == [self.name]):
                statement.module = self.new
                self.found = True
        return node


def _fixed_module_code(fullname: str, source: str, filename: str):
    """``fullname``'s code compiled from ``source`` as :data:`_SOURCE_FIXES` change it, said once;
    None where no fix is listed for it or none finds its statement (upstream's code runs as it is)."""
    fixes = [(fix(), said) for fix, said in _SOURCE_FIXES.get(fullname, ())]
    if not fixes:
        return None
    tree = ast.parse(source, filename)
    for fix, said in fixes:
        tree = fix.visit(tree)
        if fix.found:
            say_once(said)
    if not any(fix.found for fix, _ in fixes):
        return None
    return compile(ast.fix_missing_locations(tree), filename, "exec")


#: Module-level statements that stop a module loading, which no step after the import can reach:
#: the module's source as upstream's fix changed it (or, for a package upstream's docs name, as the
#: port serves TE's absence there), before it runs. One row per module.
_SOURCE_FIXES = {
    # main eaf9408232 (2025-03-08) … 028729b9bc (2025-03-15)
    "megatron.core.models.common.language_module.language_module": (
        (functools.partial(_ImportFromGuarded, "megatron.core.extensions.transformer_engine", "te_parallel_cross_entropy"),
         _TE_IMPORT_GUARDED),),
    # the nano-v3-vl snapshot branch (2026-04-21): megatron.training imports it, so nothing trained without TE
    "megatron.core.models.vision.multimodal_projector": (
        (functools.partial(_ImportFromGuarded, "transformer_engine.pytorch.distributed", "checkpoint"), _PROJECTOR_TE_IMPORT),),
    # Megatron-Bridge, where upstream's docs convert Llama since 2026-05 (its namespace is megatron's)
    "megatron.bridge.peft.lora_layers": ((_BridgeTeImportGuarded, _BRIDGE_LORA),),
    # main 5f5741db9b (2025-12-16 15:49) until the next commit, 4bdd7b10e6 (17:44): every import of
    # megatron.core reached the experts module and stopped there (ModuleNotFoundError)
    "megatron.core.transformer.moe.experts": (
        (functools.partial(_ImportFromMoved, "megatron.core.backwards_compatibility_decorators", "deprecated",
                           "megatron.core.utils"), _DEPRECATED_MOVED),),
}


_TIED_WGRAD = ("tied embeddings keep both layers' gradients under gradient-accumulation fusion, as upstream's "
               "3479e6fb26 (the embedding's was added to a torch.empty placeholder and dropped)")


class _PlaceholderWgradZeroedWhenShared(ast.NodeTransformer):
    """``grad_weight = torch.empty(...)``: zeros for a shared weight, 3479e6fb26's change of the backward."""

    found = False

    def visit_Assign(self, node):
        call = node.value
        if (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "grad_weight"
                and isinstance(call, ast.Call) and ast.unparse(call.func) == "torch.empty"):
            zeros = ast.parse("torch.zeros if getattr(weight, 'zero_out_wgrad', False) else torch.empty",
                              mode="eval").body
            call.func = ast.copy_location(zeros, call.func)
            self.found = True
        return node


class _SharedWeightsGradAdded(ast.NodeTransformer):
    """``not param.grad_added_to_main_grad``: or a shared weight, 3479e6fb26's change of the grad hook."""

    found = False

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not) and ast.unparse(node.operand) == "param.grad_added_to_main_grad":
            self.found = True
            shared = ast.parse("getattr(param, 'zero_out_wgrad', False)", mode="eval").body
            return ast.copy_location(ast.BoolOp(op=ast.Or(), values=[node, shared]), node)
        return self.generic_visit(node)


def _unfixed(function) -> bool:
    """Whether upstream's ``function`` predates 3479e6fb26 (it never names ``zero_out_wgrad``)."""
    try:
        return "zero_out_wgrad" not in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def _tied_wgrad_placeholder_zeroed(module) -> None:
    """The linear layers' backward: see :func:`_tied_weights_keep_both_gradients`."""
    cls = getattr(module, "LinearWithGradAccumulationAndAsyncCommunication", None)
    if cls is not None and _unfixed(cls.backward):
        _replaced_by_fix(cls, "backward", _PlaceholderWgradZeroedWhenShared(), module, _TIED_WGRAD)


def _tied_weights_grad_hook(module) -> None:
    """The data-parallel wrapper's gradient hook: see :func:`_tied_weights_keep_both_gradients`."""
    cls = getattr(module, "DistributedDataParallel", None)
    hook = getattr(cls, "_make_param_hook", None)
    if hook is not None and _unfixed(hook):
        _replaced_by_fix(cls, "_make_param_hook", _SharedWeightsGradAdded(), module, _TIED_WGRAD)


def _tied_weights_keep_both_gradients(module) -> None:
    """Main e801b2bb2f (2023-09-07) until 3479e6fb26 (2023-12-05), with gradient-accumulation fusion:
    the output layer, sharing its weight with the word embeddings on one stage, handed autograd a
    ``torch.empty`` placeholder, and the hook dropped the embedding's gradient added to it (GPT's grad
    norm 6 % low from the first step on 9290c730d0; fusions off never take the path). As 3479e6fb26:
    the shared weight is marked ``zero_out_wgrad`` here, the placeholder is zeros and the hook adds
    a marked weight's gradient, each only where upstream's function lacks the fix."""
    for cls_name, method_name in (("LanguageModule", "initialize_last_stage_with_word_embeddings"),
                                  ("MegatronModule", "initialize_word_embeddings")):
        cls = getattr(module, cls_name, None)
        method = getattr(cls, method_name, None)
        if method is None or getattr(method, "__rocm_port_fixed__", False) or not _unfixed(method):
            continue

        def marked(self, *args, _method=method, **kwargs):
            result = _method(self, *args, **kwargs)
            on_one_stage = getattr(self, "pre_process", True) and getattr(self, "post_process", True)
            if getattr(self, "share_embeddings_and_output_weights", False) and on_one_stage:
                self.shared_embedding_or_output_weight().zero_out_wgrad = True
                say_once(_TIED_WGRAD)
            return result

        functools.update_wrapper(marked, method)
        marked.__rocm_port_fixed__ = True
        setattr(cls, method_name, marked)


def _names_called_bare(module) -> set:
    """The names ``module``'s code calls unqualified (``f()``, not ``mpu.f()``); none where its source is not on disk."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def _bound_where_undefined(module, functions: dict, said: str) -> None:
    """Each name of ``functions`` that ``module`` calls unqualified but no longer defines, bound to its
    function (None: none to give), said once: the windows where upstream renamed or moved what it
    still called. Outside them the module calls none of these names bare, and nothing changes."""
    called = _names_called_bare(module)
    missing = {name: f for name, f in functions.items()
               if f is not None and name in called and name not in module.__dict__}
    for name, function in missing.items():
        setattr(module, name, function)
    if missing:
        say_once(said)


def _cpu_init_names_its_rank(module) -> None:
    """From v2.0 (be473a5bd2, 2021-01-12) until 7db9c1e55c (2021-01-25) mpu's
    ``_initialize_affine_weight_cpu`` called ``get_model_parallel_rank``, a name mpu had renamed
    ``get_tensor_model_parallel_rank``: with ``--use-cpu-initialization`` no parallel linear layer
    was built (``NameError``). The name is given the function upstream's fix calls."""
    _bound_where_undefined(module, {"get_model_parallel_rank": module.__dict__.get("get_tensor_model_parallel_rank")},
                           "mpu's CPU weight initialization asks get_tensor_model_parallel_rank for the rank, as "
                           "upstream's 7db9c1e55c (it called the renamed get_model_parallel_rank)")


def _layer_count_asks_mpu(module) -> None:
    """From 42c4071581 (2022-11-02, megatron/core's first commit) until 1a26b2910d (2022-11-08) the
    legacy model's ``_get_num_layers`` called three pipeline functions by names the move to
    ``megatron.core.mpu`` had left undefined: no model was built (``NameError``). They are given
    mpu's, which upstream's fix calls."""
    mpu = module.__dict__.get("mpu")
    names = ("get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank", "is_pipeline_stage_before_split")
    _bound_where_undefined(module, {name: getattr(mpu, name, None) for name in names},
                           "the legacy model counts its layers with mpu's pipeline functions, as upstream's 1a26b2910d")


@dataclasses.dataclass(frozen=True)
class _LayerKeyword:
    """Keywords ``TransformerLayer`` gave every self-attention in a window of upstream's history,
    which the ``Attention`` base class's method took and MLA's own did not: every MLA model
    (DeepSeek) stopped at its build or first step, ``TypeError: ... unexpected keyword argument``,
    on any machine, ported or not, until upstream's fix added them to MLA's method."""

    owner: str
    method: str
    names: tuple
    said: str
    #: upstream's fix asserts this of a value that is not None (a feature MLA lacks); None: taken unused
    refused: str | None = None


_MLA_LAYER_KEYWORDS = (
    # 2e047cff8a (2024-10-29, flash decoding) ... 60d5b383fa (2024-12-07), which asserts them None
    _LayerKeyword("MultiLatentAttention", "forward", ("rotary_pos_cos", "rotary_pos_sin"),
                  "MultiLatentAttention takes the rotary_pos_cos/rotary_pos_sin TransformerLayer passes every attention "
                  "(flash decoding's, None in training), as upstream's 60d5b383fa (it did not: DeepSeek stopped at its "
                  "first step)", refused="MLA does not support Flash Decoding"),
    # 2bdc60c4af (2024-11-15, --cp-comm-type defaults to p2p) ... 60d5b383fa (2024-12-07); the core attention
    # MLA builds without TE takes it unused, and the port's CP attention reads the config's
    _LayerKeyword("MLASelfAttention", "__init__", ("cp_comm_type",),
                  "MLASelfAttention takes the cp_comm_type TransformerLayer passes every attention, as upstream's "
                  "60d5b383fa (it did not: DeepSeek built nothing); its core attention reads the config's"),
    # 8fba594837 (2025-01-09, inference CUDA graphs) ... b5836f82f6 (2025-02-10, "MLA_Fix"), unused in training
    _LayerKeyword("MultiLatentAttention", "forward", ("sequence_len_offset",),
                  "MultiLatentAttention takes the sequence_len_offset TransformerLayer passes every attention, as "
                  "upstream's b5836f82f6 (it did not: DeepSeek stopped at its first step)"),
)


def _mla_takes_the_layers_keywords(module) -> None:
    """MLA's methods take what the layer gives every attention (:data:`_MLA_LAYER_KEYWORDS`), as
    upstream's fixes add it: only the keywords the base class's method takes and MLA's own does not."""
    base = getattr(module, "Attention", None)
    for owner_name, method in dict.fromkeys((k.owner, k.method) for k in _MLA_LAYER_KEYWORDS):
        owner = getattr(module, owner_name, None)
        function = vars(owner).get(method) if owner is not None else None
        if base is None or function is None or getattr(function, "__rocm_port_layer_keywords__", False):
            continue
        taken, own = inspect.signature(getattr(base, method)).parameters, inspect.signature(function).parameters
        missing = [k for k in _MLA_LAYER_KEYWORDS if (k.owner, k.method) == (owner_name, method)
                   and all(n in taken and n not in own for n in k.names)]
        if missing:
            setattr(owner, method, _taking(function, {name: k.refused for k in missing for name in k.names}))
            for keyword in missing:
                say_once(keyword.said)


def _taking(function, refused: dict):
    """``function`` given the keywords ``refused`` names: dropped where None or where nothing is
    refused, else the refusal raised (as upstream's assert)."""
    @functools.wraps(function)
    def taking_the_layers_keywords(self, *args, **kwargs):
        for name, why in refused.items():
            if kwargs.pop(name, None) is not None and why:
                raise AssertionError(why)
        return function(self, *args, **kwargs)

    taking_the_layers_keywords.__rocm_port_layer_keywords__ = True
    return taking_the_layers_keywords


_MLA_QUERY = ("MultiLatentAttention hands its query to the KV-cache update as the attention base class asks, as "
              "upstream's 369fec6c7c (it passed key and value alone: DeepSeek stopped at its first step)")


class _QueryThroughTheCacheUpdate(ast.NodeTransformer):
    """``key, value, _, mask = self._adjust_key_value_for_inference(params, key, value, ...)`` ->
    ``query, key, value, _, mask = self._adjust_key_value_for_inference(params, query, key, value, ...)``:
    upstream's 369fec6c7c, the one statement it changed; ``found`` says whether it was there."""

    found = False

    def visit_Assign(self, node):
        target, call = node.targets[0], node.value
        if (len(node.targets) == 1 and isinstance(target, ast.Tuple) and len(target.elts) == 4
                and isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "_adjust_key_value_for_inference" and len(call.args) == 3
                and [getattr(a, "id", None) for a in call.args[1:]] == ["key", "value"]):
            target.elts.insert(0, ast.copy_location(ast.Name(id="query", ctx=ast.Store()), target.elts[0]))
            call.args.insert(1, ast.copy_location(ast.Name(id="query", ctx=ast.Load()), call.args[1]))
            self.found = True
        return node


def _mla_hands_its_query_to_the_cache_update(module) -> None:
    """From 2e047cff8a (2024-10-29, flash decoding) until 369fec6c7c reached main (bc8c4f3562,
    2024-11-07) ``Attention._adjust_key_value_for_inference`` took the query too and returned it,
    while ``MultiLatentAttention.forward`` still called it with key and value alone: every MLA model
    (DeepSeek) failed ``TypeError: ... missing 1 required positional argument: 'value'``, any device,
    ported or not. Upstream's method with its fix's call (:func:`_recompiled`), only where the base
    class asks for the query; nothing changes where the call already passes it."""
    cls, base = getattr(module, "MultiLatentAttention", None), getattr(module, "Attention", None)
    adjust = getattr(base, "_adjust_key_value_for_inference", None)
    if cls is not None and adjust is not None and "query" in inspect.signature(adjust).parameters:
        _replaced_by_fix(cls, "forward", _QueryThroughTheCacheUpdate(), module, _MLA_QUERY)


_LOCAL_EXPERT_SPLITS = ("the all-to-all dispatcher sorts its tokens by the per-local-expert counts it viewed for that, "
                        "as upstream's e6b3c4921f (it took the unviewed [tp, ep, experts] counts: with TP and EP above "
                        "1 and several local experts the tokens went to other experts)")


class _CountsViewedPerLocalExpert(ast.NodeTransformer):
    """``self.num_global_tokens_per_local_expert = num_global_tokens_per_local_expert.to(...)`` ->
    the same of ``self.num_global_tokens_per_local_expert`` (the counts just viewed as
    ``[tp * ep, num_local_experts]``): upstream's e6b3c4921f, the receiver it changed."""

    found = False

    def visit_Assign(self, node):
        target, value = node.targets[0], node.value
        if (len(node.targets) == 1 and isinstance(target, ast.Attribute)
                and target.attr == "num_global_tokens_per_local_expert"
                and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to"
                and isinstance(value.func.value, ast.Name) and value.func.value.id == "num_global_tokens_per_local_expert"):
            value.func.value = ast.copy_location(
                ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr=target.attr, ctx=ast.Load()),
                value.func.value)
            self.found = True
        return node


def _dispatcher_sorts_by_viewed_counts(module) -> None:
    """From 044e2ad5aa (2025-02-10, permute fusion) until e6b3c4921f (2025-03-12, "Fix moe convergence
    issue when local_expert > 1 & a2a dispatcher & tp>1 & ep>1") ``MoEAlltoAllTokenDispatcher.preprocess``
    kept the counts it had not viewed per local expert for the sort after the all-to-all: tokens reached
    other experts than the router chose, on any machine (core-0.11's Mixtral ep2-tp2: grad norms 17.5 %
    from one rank over 50 iterations, ep2 alone unaffected). Upstream's method with its fix's receiver
    (:func:`_recompiled`); nothing changes where the line is not there."""
    dispatcher = getattr(module, "MoEAlltoAllTokenDispatcher", None)
    if dispatcher is not None:
        _replaced_by_fix(dispatcher, "preprocess", _CountsViewedPerLocalExpert(), module, _LOCAL_EXPERT_SPLITS)


_SELECTIVE = ("selective recomputation takes no recompute method, as upstream's 8b9a2510f5 has it (TransformerConfig "
              "asked for one, which the parser refuses beside selective: it never started)")


def _refuses_selective_without_a_method(post_init) -> bool:
    """Whether ``post_init`` raises for a missing recompute method whatever the granularity: its
    ``if self.recompute_method is not None:`` has a bare ``raise`` for its ``else``."""
    try:
        lines, first = inspect.getsourcelines(post_init)
    except (OSError, TypeError):
        return False
    return any(isinstance(node, ast.If) and ast.unparse(node.test) == "self.recompute_method is not None"
               and len(node.orelse) == 1 and isinstance(node.orelse[0], ast.Raise)
               for node in ast.walk(_parsed_at_its_lines("".join(lines), first)))


def _selective_recompute_takes_no_method(module) -> None:
    """From 3316e811cc (main 2023-06-29, core's TransformerConfig) until 8b9a2510f5 (main 2023-07-06;
    Megatron-DeepSpeed until d9fa3022, 2023-09-18) ``--recompute-granularity selective`` needed a
    recompute method, which the parser refuses beside it: selective recomputation never started
    (``ValueError``). As upstream's fix, the method check is for full recomputation alone: the
    check passes a method for the call and the config keeps none."""
    cls = getattr(module, "TransformerConfig", None)
    original = getattr(cls, "__post_init__", None)
    if (original is None or getattr(original, "__rocm_port_fixed__", False)
            or not _refuses_selective_without_a_method(original)):
        return

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if self.recompute_granularity != "selective" or self.recompute_method is not None:
            return original(self, *args, **kwargs)
        say_once(_SELECTIVE)
        self.recompute_method = "uniform"
        try:
            return original(self, *args, **kwargs)
        finally:
            self.recompute_method = None

    __post_init__.__rocm_port_fixed__ = True
    cls.__post_init__ = __post_init__
