"""What upstream's distributed optimizer needs of torch's Adam/AdamW state, which apex's and TE's
FusedAdam keep elsewhere: its ``step``. Without apex or TE the optimizer is torch's (upstream's
fallback, or the port's FusedAdam where upstream imports apex unguarded), which keeps ``step``
per parameter and only from its first step on; upstream's checkpointing asks for it before that."""

from __future__ import annotations

import contextlib
import functools

import torch

from .apex_substitutes import FusedAdam
from .say import say_once

_STEP_SERVED = ("the distributed optimizer asked torch's Adam for its step before its first step (building the state "
                "a checkpoint loads into): served as 0, the checkpoint's own step replaces it")


@contextlib.contextmanager
def _step_zero_while_unset(optimizer):
    """Every parameter of ``optimizer`` whose state has no ``step`` holds step 0 inside, nothing after."""
    unset = [p for group in optimizer.param_groups for p in group["params"] if "step" not in optimizer.state.get(p, {})]
    for p in unset:
        optimizer.state[p]["step"] = torch.tensor(0.0)  # torch's state: a defaultdict(dict)
    try:
        yield
    finally:
        for p in unset:
            optimizer.state[p].pop("step", None)
            if not optimizer.state[p]:
                del optimizer.state[p]


def _step_before_the_first_step(module) -> None:
    """Upstream from de16089be4 (2024-07-30) on: without apex or TE, ``DistributedOptimizer.state_dict``
    reads ``step`` from torch's per-parameter state and asserts there is one, but loading a
    checkpoint builds that state dict before any step (``sharded_state_dict`` calls it first), so
    every resume with ``--use-distributed-optimizer`` fails ``assert len(steps) == 1`` (``KeyError:
    'step'`` in 2024, whose load first gives the state ``exp_avg``/``exp_avg_sq`` alone). Before the
    first step torch's Adam is at step 0: the state dict says so, and the state is left as it was."""
    cls = getattr(module, "DistributedOptimizer", None)
    if cls is None or getattr(module, "HAVE_APEX_OR_TE", True) or getattr(cls.state_dict, "_rocm_port", False):
        return
    state_dict = cls.state_dict

    @functools.wraps(state_dict)
    def served(self):
        inner = self.optimizer
        if not isinstance(inner, torch.optim.Optimizer) or any("step" in inner.state.get(p, {})
                                                               for g in inner.param_groups for p in g["params"]):
            return state_dict(self)
        say_once(_STEP_SERVED)
        with _step_zero_while_unset(inner):
            return state_dict(self)

    served._rocm_port = True
    cls.state_dict = served



_STEP_RESTORED = ("the distributed optimizer's load gave torch's Adam one step tensor for every parameter (each step "
                  "would advance it once per parameter): each parameter gets its own, holding the checkpoint's step")


def _checkpoint_step(state_dict) -> float | None:
    """The one step the checkpoint's param groups hold (upstream writes it there without apex/TE)."""
    groups = state_dict.get("optimizer", {}).get("param_groups", []) if isinstance(state_dict, dict) else []
    steps = {g["step"] for g in groups if g.get("step") is not None}
    return float(steps.pop()) if len(steps) == 1 else None


def _checkpoint_step_per_parameter(module) -> None:
    """Upstream from de16089be4 (2024-07-30) on, without apex or TE, ``DistributedOptimizer.load_state_dict``
    puts one ``torch.tensor(step)`` into every parameter's state of torch's Adam (which increments
    each parameter's step in place: the shared one grows by the number of parameters per iteration;
    main's ``dp_reshardable`` parameter state also copied the step of the state it loaded into over
    it, which :func:`_param_state_without_step` leaves out). Adam's bias correction goes wrong and
    the resumed run leaves the uninterrupted one from its second iteration (DP2 on main: grad norm
    10 % apart). Each parameter gets its own tensor holding the checkpoint's step (its param groups')."""
    cls = getattr(module, "DistributedOptimizer", None)
    if cls is None or getattr(module, "HAVE_APEX_OR_TE", True) or getattr(cls.load_state_dict, "_rocm_port", False):
        return
    load_state_dict = cls.load_state_dict

    @functools.wraps(load_state_dict)
    def served(self, state_dict):
        result = load_state_dict(self, state_dict)
        step = _checkpoint_step(state_dict)
        states = [s for s in getattr(self.optimizer, "state", {}).values() if isinstance(s, dict)
                  and isinstance(s.get("step"), torch.Tensor)]
        if step is None or not states:
            return result
        if len({id(s["step"]) for s in states}) < len(states) or any(s["step"].item() != step for s in states):
            say_once(_STEP_RESTORED)
        for s in states:
            s["step"] = torch.tensor(step, dtype=s["step"].dtype, device=s["step"].device)
        return result

    served._rocm_port = True
    cls.load_state_dict = served


_STEP_LEFT_OUT = ("the distributed optimizer's dp_reshardable parameter state left out torch's Adam 0-dim step (the "
                  "param groups hold it), which upstream wrote as a shard of the gradient buffer or read back over the "
                  "loaded step")


def _main_param_step(optimizer, model_param):
    """The step tensor in torch's Adam state of ``model_param``'s main (fp32) shard; None without one."""
    group_index, group_order = optimizer.model_param_group_index_map[model_param]
    main_param = optimizer.optimizer.param_groups[group_index]["params"][group_order]
    return optimizer.optimizer.state[main_param].get("step")


def _param_state_without_step(module) -> None:
    """Upstream from 3d19693bc8 (2025-08-23, the ``dp_reshardable`` format) until f4502eb1c9
    (2026-02-02) writes torch's per-parameter 0-dim ``step`` as if it were a shard of the gradient
    buffer: without apex or TE the first save with ``--use-distributed-optimizer`` fails
    ``AssertionError: (torch.Size([]), 0, N)``. As f4502eb1c9 and the other formats have it, the step
    is no part of the parameter state (its param groups hold it): left out where the state is read,
    and kept as it is where the state is written back. Written back without autograd: in fp32 the
    main param is a view of the model's parameter, a leaf that requires grad, and upstream's in-place
    copy into it failed every fp32 resume in this format ("a view of a leaf Variable that requires
    grad is being used in an in-place operation"; main 2026-08, Mixtral)."""
    cls = getattr(module, "DistributedOptimizer", None)
    get_state = getattr(cls, "get_parameter_state_dp_reshardable", None)
    if get_state is None or getattr(module, "HAVE_APEX_OR_TE", True) or getattr(get_state, "_rocm_port", False):
        return
    set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(get_state)
    def without_step(self):
        state = get_state(self)
        for key, per_dtype in state.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for tensors in bucket:
                            if tensors.pop("step", None) is not None:
                                say_once(_STEP_LEFT_OUT)
        return state

    @functools.wraps(set_states)
    def step_kept(self, model_param, tensors):
        aware = getattr(self.config, "use_precision_aware_optimizer", False)  # TE's FusedAdam: no torch step
        step = None if "step" in tensors or aware else _main_param_step(self, model_param)
        with torch.no_grad():  # fp32: the main param is a view of the model's, a leaf that requires grad
            return set_states(self, model_param, tensors if step is None else {**tensors, "step": step})

    without_step._rocm_port = step_kept._rocm_port = True
    cls.get_parameter_state_dp_reshardable, cls._set_main_param_and_optimizer_states = without_step, step_kept


_STEP_OUT_OF_MODEL_SPACE = ("the distributed optimizer's fully_sharded_model_space state left out torch's Adam 0-dim "
                            "step (the param groups hold it), which upstream made a flattened shard of each parameter")


@contextlib.contextmanager
def _steps_hidden(optimizer):
    """torch's Adam state of ``optimizer`` without its ``step`` inside, as it was after."""
    hidden = {p: state.pop("step") for p, state in optimizer.state.items() if isinstance(state, dict) and "step" in state}
    try:
        yield bool(hidden)
    finally:
        for p, step in hidden.items():
            optimizer.state[p]["step"] = step


def _model_space_state_without_step(module) -> None:
    """Upstream from 03306e67e2 (2024-07-30) until 3364154e89 (2025-02-14), without apex or TE: the
    ``fully_sharded_model_space`` parameter state (the default distributed-optimizer checkpoint of
    the time) makes every entry of torch's per-parameter state a flattened shard of the parameter,
    its 0-dim ``step`` too, so the first save with ``--use-distributed-optimizer`` fails ("Data
    should be 1D for a flattened ShardedTensor", core 0.9), and a load would ask for a step it
    never wrote. As 3364154e89 has it, the step is no part of that state (the param groups hold
    it): hidden while the state is built and while it is loaded back."""
    cls = getattr(module, "DistributedOptimizer", None)
    if cls is None or getattr(module, "HAVE_APEX_OR_TE", True):
        return
    for name in ("sharded_param_state_fs_model_space", "load_parameter_state_from_fs_model_space"):
        method = getattr(cls, name, None)
        if method is None or getattr(method, "_rocm_port", False):
            continue

        def without_step(self, *args, _method=method, **kwargs):
            inner = self.optimizer
            if not isinstance(inner, torch.optim.Optimizer):
                return _method(self, *args, **kwargs)
            with _steps_hidden(inner) as hid:
                if hid:
                    say_once(_STEP_OUT_OF_MODEL_SPACE)
                return _method(self, *args, **kwargs)

        functools.update_wrapper(without_step, method)
        without_step._rocm_port = True
        setattr(cls, name, without_step)


_STEP_IN_GROUPS = ("torch's Adam writes its step into its param groups too, where apex's and TE's FusedAdam keep it "
                   "(an NVIDIA box resuming the checkpoint goes on with Adam's bias correction), and a parameter "
                   "state loaded without a step takes its group's")


def _group_steps_written(optimizer, state_dict):
    """State-dict post-hook: each param group holds the one step its parameters' states hold."""
    for group in state_dict.get("param_groups", []):
        steps = {float(state_dict["state"][i]["step"]) for i in group.get("params", [])
                 if "step" in state_dict["state"].get(i, {})}
        if len(steps) == 1 and "step" not in group:
            group["step"] = int(steps.pop())
    return state_dict


def _group_steps_read(optimizer, state_dict):
    """Load pre-hook: a parameter state without ``step`` (an apex or TE checkpoint) takes its group's."""
    for group in state_dict.get("param_groups", []):
        if group.get("step") is None:
            continue
        for i in group.get("params", []):
            state = state_dict["state"].get(i)
            if state and state.get("step") is None:  # from 2024-07-10: apex's common_step None
                state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
    return state_dict


def _torch_adams_step_in_param_groups(module) -> None:
    """Upstream from 2024-08 on falls back to torch's Adam/AdamW without apex or TE; it keeps its step
    per parameter, apex's and TE's FusedAdam in the param groups. Upstream's own one-rank checkpoint
    of torch's Adam, resumed on an NVIDIA box, restarted Adam's bias correction there (main 2026-08
    Llama: 5.4 % in loss), and an NVIDIA box's, resumed without apex or TE, has no parameter step
    for torch's Adam to read (``KeyError: 'step'``). The optimizer upstream wraps keeps both: its
    state dict writes each group's step, and a loaded state without one takes it (torch's own
    state-dict hooks, per optimizer; the port's FusedAdam already keeps apex's)."""
    cls = getattr(module, "MegatronOptimizer", None)
    if cls is None or getattr(cls.__init__, "_rocm_port", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def hooked(self, optimizer, *args, **kwargs):
        init(self, optimizer, *args, **kwargs)
        if (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not isinstance(optimizer, FusedAdam)
                and not getattr(optimizer, "_rocm_port", False)):
            say_once(_STEP_IN_GROUPS)
            optimizer.register_state_dict_post_hook(_group_steps_written)
            optimizer.register_load_state_dict_pre_hook(_group_steps_read)
            optimizer._rocm_port = True

    hooked._rocm_port = True
    cls.__init__ = hooked
