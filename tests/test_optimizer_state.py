"""What the port serves upstream's distributed optimizer of torch's Adam (rocm_port's
``optimizer_state``): its ``step`` before the first step, and after a resume each parameter's own
step, the checkpoint's. The class below keeps upstream main's lines for an optimizer without apex
or TE (``HAVE_APEX_OR_TE`` False), reduced to the step; the whole run is in
``megaport verify --checks resume`` (dp2-distopt)."""

from __future__ import annotations

import copy
import types

import pytest

torch = pytest.importorskip("torch")

from support.port import load as _load  # noqa: E402

MODULE = "megatron.core.optimizer.distrib_optimizer"


class _UpstreamDistributedOptimizer:
    """upstream main's DistributedOptimizer (d98e8a64dd), its no-apex/TE lines for the step."""

    def __init__(self, params):
        self.optimizer = torch.optim.Adam(params, lr=0.1)
        self.template = {}

    def state_dict(self):
        inner_state_dict = self.optimizer.state_dict()
        steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))
        assert len(steps) == 1
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner_state_dict["param_groups"]]
        for group in groups:
            group["step"] = steps[0]
        return {"optimizer": {"param_groups": groups}}

    def sharded_state_dict_for_loading(self):
        """``sharded_state_dict(is_loading=True)``: the template, its param state's step kept local."""
        state_dict = self.state_dict()
        self.load_state_dict(self.state_dict())
        self.template = {p: dict(s) for p, s in self.optimizer.state.items()}
        return state_dict

    def load_state_dict(self, state_dict):
        steps = list(set([g["step"] for g in state_dict["optimizer"]["param_groups"]]))
        assert len(steps) == 1
        step = torch.tensor(steps[0], dtype=torch.float)
        state = {i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": step}
                 for i, p in enumerate(self.optimizer.param_groups[0]["params"])}
        self.optimizer.load_state_dict({"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]})
        for p, loaded in self.template.items():  # load_parameter_state_from_dp_reshardable
            for key, value in self.optimizer.state[p].items():
                value.copy_(loaded[key])


def _module(have_apex_or_te: bool = False, upstream=None):
    """The distrib_optimizer module with ``upstream``'s DistributedOptimizer (main's by default)."""
    module = types.ModuleType(MODULE)
    module.HAVE_APEX_OR_TE = have_apex_or_te
    module.DistributedOptimizer = type("DistributedOptimizer", (upstream or _UpstreamDistributedOptimizer,), {})
    return module


@pytest.fixture()
def rp():
    module = _load(None)
    yield module
    module.uninstall_import_blocker()


def _served(rp, have_apex_or_te: bool = False):
    module = _module(have_apex_or_te)
    for step in rp.after_import_steps(MODULE):
        step(module)
    return module


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]


def _train(optimizer, steps: int) -> None:
    for _ in range(steps):
        for p in optimizer.param_groups[0]["params"]:
            p.grad = p.detach().clone()
        optimizer.step()


def test_upstream_fails_as_the_issue_says():
    with pytest.raises(AssertionError):
        _module().DistributedOptimizer(_params()).sharded_state_dict_for_loading()


def test_the_step_before_the_first_step_is_zero_and_leaves_the_state(rp, capsys):
    rp.say._SAID.clear()
    optimizer = _served(rp).DistributedOptimizer(_params())
    assert {g["step"] for g in optimizer.state_dict()["optimizer"]["param_groups"]} == {0.0}
    assert len(optimizer.optimizer.state) == 0
    assert capsys.readouterr().out.count("> ROCm port: the distributed optimizer asked torch's Adam for its step") == 1


def test_a_resume_steps_as_the_uninterrupted_run(rp, capsys):
    rp.say._SAID.clear()
    uninterrupted = _served(rp).DistributedOptimizer(_params())
    _train(uninterrupted.optimizer, 3)
    saved = uninterrupted.state_dict()
    resumed = _served(rp).DistributedOptimizer(_params())
    resumed.sharded_state_dict_for_loading()
    resumed.load_state_dict(saved)
    steps = [s["step"] for s in resumed.optimizer.state.values()]
    assert len({id(s) for s in steps}) == len(steps) and {s.item() for s in steps} == {3.0}
    _train(resumed.optimizer, 1)
    assert {s["step"].item() for s in resumed.optimizer.state.values()} == {4.0}
    assert "> ROCm port: the distributed optimizer's load gave torch's Adam one step tensor" in capsys.readouterr().out


def test_without_the_port_a_resume_shares_and_resets_the_step():
    upstream = _module().DistributedOptimizer(_params())
    _train(upstream.optimizer, 3)
    saved = upstream.state_dict()
    resumed = _module().DistributedOptimizer(_params())
    resumed.template = {p: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4), "step": torch.tensor(0.0)}
                        for p in resumed.optimizer.param_groups[0]["params"]}
    resumed.load_state_dict(saved)
    steps = [s["step"] for s in resumed.optimizer.state.values()]
    assert len({id(s) for s in steps}) == 1 and steps[0].item() == 0.0


def test_apex_or_te_present_is_left_alone(rp):
    module = _served(rp, have_apex_or_te=True)
    assert module.DistributedOptimizer.state_dict is _UpstreamDistributedOptimizer.state_dict
    assert module.DistributedOptimizer.load_state_dict is _UpstreamDistributedOptimizer.load_state_dict


class _UpstreamDpReshardable(_UpstreamDistributedOptimizer):
    """upstream 2025-11's dp_reshardable parameter state (6c8cdd57de): every tensor of a parameter's
    state is taken for a shard of the gradient buffer, and written back key by key."""

    def __init__(self, params):
        super().__init__(params)
        self.config = types.SimpleNamespace(use_precision_aware_optimizer=False)
        self.model_param_group_index_map = {p: (0, i) for i, p in enumerate(params)}

    def _get_main_param_and_optimizer_states(self, model_param):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        return {"param": main_param, **self.optimizer.state[main_param]}

    def get_parameter_state_dp_reshardable(self):
        params = list(self.model_param_group_index_map)
        return {"per_bucket_numel": [12], 0: {torch.float32: [[self._get_main_param_and_optimizer_states(p)
                                                                for p in params]]}}

    def sharded_param_state_dp_reshardable(self):
        for tensors in self.get_parameter_state_dp_reshardable()[0][torch.float32][0]:
            for key in tensors:
                assert tensors[key].shape == (4,), (tensors[key].shape, 0, 4)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst_tensors = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():  # upstream's loaders run under torch.no_grad()
            for key in dst_tensors:
                dst_tensors[key].copy_(tensors[key])


def test_upstream_2025_11_cannot_save_the_parameter_state():
    optimizer = _module(upstream=_UpstreamDpReshardable).DistributedOptimizer(_params())
    _train(optimizer.optimizer, 1)
    with pytest.raises(AssertionError, match=r"torch.Size\(\[\]\)"):
        optimizer.sharded_param_state_dp_reshardable()


def test_the_parameter_state_leaves_the_step_to_the_param_groups(rp, capsys):
    module = _module(upstream=_UpstreamDpReshardable)
    for step in rp.after_import_steps(MODULE):
        step(module)
    optimizer = module.DistributedOptimizer(_params())
    _train(optimizer.optimizer, 2)
    optimizer.sharded_param_state_dp_reshardable()  # saves
    saved = [{k: v.clone() for k, v in t.items()} for t in optimizer.get_parameter_state_dp_reshardable()[0][
        torch.float32][0]]
    assert all("step" not in t and set(t) == {"param", "exp_avg", "exp_avg_sq"} for t in saved)
    assert capsys.readouterr().out.count("> ROCm port: the distributed optimizer's dp_reshardable") == 1
    for model_param, tensors in zip(optimizer.model_param_group_index_map, saved):
        optimizer._set_main_param_and_optimizer_states(model_param, tensors)  # loads: the step stays
    assert {s["step"].item() for s in optimizer.optimizer.state.values()} == {2.0}


def test_the_ports_fused_adam_resumes_as_upstream_2024_rebuilds_it(rp, capsys):
    """Upstream 2023-05-24 … 2024-07-30 saves apex's param groups and, on a resume, rebuilds each
    parameter's state as exp_avg/exp_avg_sq alone (distrib_optimizer.load_state_dict): the port's
    FusedAdam keeps apex's step in its groups and steps on from it, as the uninterrupted run."""
    uninterrupted = rp.FusedAdam(_params(), lr=0.1)
    _train(uninterrupted, 3)
    saved = uninterrupted.state_dict()
    assert {g["step"] for g in saved["param_groups"]} == {3}
    resumed = rp.FusedAdam(_params(), lr=0.1)
    rebuilt = {i: {k: v.clone() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
               for i, s in saved["state"].items()}
    resumed.load_state_dict({"state": rebuilt, "param_groups": saved["param_groups"]})
    for p, q in zip(resumed.param_groups[0]["params"], uninterrupted.param_groups[0]["params"]):
        with torch.no_grad():
            p.copy_(q)
    _train(uninterrupted, 2)
    _train(resumed, 2)
    for p, q in zip(resumed.param_groups[0]["params"], uninterrupted.param_groups[0]["params"]):
        assert torch.equal(p, q)
    assert {s["step"].item() for s in resumed.state.values()} == {5.0}
    assert capsys.readouterr().out.count("> ROCm port: the distributed optimizer loaded FusedAdam's state") == 1


def test_torch_adamw_fails_the_same_rebuild():
    adamw = torch.optim.AdamW(_params(), lr=0.1)
    _train(adamw, 1)
    saved = adamw.state_dict()
    rebuilt = {i: {k: v for k, v in s.items() if k != "step"} for i, s in saved["state"].items()}
    with pytest.raises(KeyError, match="step"):
        adamw.load_state_dict({"state": rebuilt, "param_groups": saved["param_groups"]})


class _UpstreamModelSpace(_UpstreamDistributedOptimizer):
    """upstream 2024-07-30 … 2025-02-14's fully_sharded_model_space parameter state (core 0.9,
    772faca1f8): each entry of a parameter's state becomes a flattened shard of the parameter, which
    must be 1-D, and the load copies every entry of the state back."""

    def sharded_param_state_fs_model_space(self, model_sharded_state_dict=None, is_loading=False):
        state = {}
        for index, main_param in enumerate(self.optimizer.param_groups[0]["params"]):
            tensors = {"fp32_param": main_param, **self.optimizer.state[main_param]}
            for key, value in tensors.items():
                if value.dim() != 1:  # ShardedTensor.validate_metadata_integrity
                    raise ValueError(f"Data should be 1D for a flattened ShardedTensor(key='optimizer.state.{key}')")
            state[index] = {k: v.clone() for k, v in tensors.items()}
        return state

    def load_parameter_state_from_fs_model_space(self, state_dict):
        for index, main_param in enumerate(self.optimizer.param_groups[0]["params"]):
            dst_tensors = {"fp32_param": main_param, **self.optimizer.state[main_param]}
            with torch.no_grad():
                for key in dst_tensors:
                    dst_tensors[key].copy_(state_dict[index][key])


def test_upstream_core_0_9_cannot_save_the_model_space_state():
    optimizer = _module(upstream=_UpstreamModelSpace).DistributedOptimizer(_params())
    _train(optimizer.optimizer, 1)
    with pytest.raises(ValueError, match="Data should be 1D"):
        optimizer.sharded_param_state_fs_model_space()


def test_the_model_space_state_leaves_the_step_to_the_param_groups(rp, capsys):
    rp.say._SAID.clear()
    module = _module(upstream=_UpstreamModelSpace)
    for step in rp.after_import_steps(MODULE):
        step(module)
    optimizer = module.DistributedOptimizer(_params())
    _train(optimizer.optimizer, 2)
    saved = optimizer.sharded_param_state_fs_model_space()
    assert all(set(t) == {"fp32_param", "exp_avg", "exp_avg_sq"} for t in saved.values())
    assert {s["step"].item() for s in optimizer.optimizer.state.values()} == {2.0}  # the state as it was
    _train(optimizer.optimizer, 1)
    optimizer.load_parameter_state_from_fs_model_space(saved)  # loads: the step stays the optimizer's
    assert {s["step"].item() for s in optimizer.optimizer.state.values()} == {3.0}
    assert torch.equal(optimizer.optimizer.state[optimizer.optimizer.param_groups[0]["params"][0]]["exp_avg"],
                       saved[0]["exp_avg"])
    assert capsys.readouterr().out.count("> ROCm port: the distributed optimizer's fully_sharded_model_space") == 1


class _UpstreamFp32DpReshardable(_UpstreamDpReshardable):
    """main 2026-08's write-back in fp32: the main param is a view of the model's parameter (a leaf
    that requires grad), and the in-place copy runs without ``torch.no_grad()``."""

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst_tensors = {"param": main_param.view(-1), **self.optimizer.state[main_param]}
        for key in dst_tensors:
            if isinstance(tensors.get(key), torch.Tensor):
                dst_tensors[key].copy_(tensors[key])

    def load_parameter_state_from_dp_reshardable(self, saved):
        for model_param, tensors in zip(self.model_param_group_index_map, saved):
            self._set_main_param_and_optimizer_states(model_param, tensors)


def test_an_fp32_resume_writes_the_main_params_back_without_autograd(rp):
    """Mixtral's fp32 resume on main 2026-08 failed "a view of a leaf Variable that requires grad is
    being used in an in-place operation" there; the port writes the state back under no_grad."""
    unported = _module(upstream=_UpstreamFp32DpReshardable).DistributedOptimizer(_params())
    _train(unported.optimizer, 1)
    saved = [{k: v.detach().clone() for k, v in t.items()} for t in unported.get_parameter_state_dp_reshardable()[0][
        torch.float32][0]]
    with pytest.raises(RuntimeError, match="a view of a leaf Variable"):
        unported._set_main_param_and_optimizer_states(next(iter(unported.model_param_group_index_map)), saved[0])
    module = _module(upstream=_UpstreamFp32DpReshardable)
    for step in rp.after_import_steps(MODULE):
        step(module)
    ported = module.DistributedOptimizer(_params())
    _train(ported.optimizer, 1)
    for model_param, tensors in zip(ported.model_param_group_index_map, saved):
        ported._set_main_param_and_optimizer_states(model_param, {k: v for k, v in tensors.items() if k != "step"})
    assert all(torch.equal(p, t["param"]) for p, t in zip(ported.optimizer.param_groups[0]["params"], saved))


def test_the_baseline_shim_loads_the_fp32_state_without_autograd_too():
    """Written apart from the port: unported upstream's whole dp_reshardable load under no_grad."""
    from megaport.train.shims import registry

    saved_from = _module(upstream=_UpstreamFp32DpReshardable).DistributedOptimizer(_params())
    _train(saved_from.optimizer, 1)
    saved = [{k: v.detach().clone() for k, v in t.items() if k != "step"}
             for t in saved_from.get_parameter_state_dp_reshardable()[0][torch.float32][0]]
    unfixed = _module(upstream=_UpstreamFp32DpReshardable).DistributedOptimizer(_params())
    with pytest.raises(RuntimeError, match="a view of a leaf Variable"):
        unfixed.load_parameter_state_from_dp_reshardable(saved)
    module = _module(upstream=_UpstreamFp32DpReshardable)
    registry.REGISTRY["dp-reshardable-no-grad"].loaded_without_autograd(module)
    shimmed = module.DistributedOptimizer(_params())
    shimmed.load_parameter_state_from_dp_reshardable(saved)
    assert all(torch.equal(p, t["param"]) for p, t in zip(shimmed.optimizer.param_groups[0]["params"], saved))


OPTIMIZER_MODULE = "megatron.core.optimizer.optimizer"


class _UpstreamMegatronOptimizer:
    """upstream's MegatronOptimizer wrapping the torch optimizer it was given (its state dict is the
    inner optimizer's: Float16OptimizerWithFloat16Params / FP32Optimizer on one rank)."""

    def __init__(self, optimizer, config=None, init_state_fn=None):
        self.optimizer = optimizer


def _wrapped(rp, optimizer):
    module = types.ModuleType(OPTIMIZER_MODULE)
    module.MegatronOptimizer = type("MegatronOptimizer", (_UpstreamMegatronOptimizer,), {})
    for step in rp.after_import_steps(OPTIMIZER_MODULE):
        step(module)
    return module.MegatronOptimizer(optimizer).optimizer


def _nvidia_box_adam(params):
    """An NVIDIA box's fused Adam: apex's state layout (the step in the param groups only), the
    baseline's stand-in."""
    from megaport.train.shims.apex_pytorch import FusedAdam as ApexFusedAdam

    return ApexFusedAdam(params, lr=0.1, weight_decay=0.1)


def _same_params(a, b) -> None:
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        with torch.no_grad():
            p.copy_(q)


def _apart(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]))


def test_an_nvidia_box_resumes_torch_adams_checkpoint_with_its_step(rp, capsys):
    """main 2026-08 without apex or TE trains with torch's AdamW; an NVIDIA box's fused Adam reads
    the step from the param groups: without them it restarted bias correction (5.4 % in loss)."""
    rp.say._SAID.clear()
    uninterrupted = _wrapped(rp, torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.1))
    _train(uninterrupted, 3)
    saved = copy.deepcopy(uninterrupted.state_dict())  # as written to disk: no moment shared with the writer
    assert {g["step"] for g in saved["param_groups"]} == {3}
    box = _nvidia_box_adam(_params())
    box.load_state_dict(saved)
    _same_params(box, uninterrupted)
    _train(uninterrupted, 2)
    _train(box, 2)
    assert _apart(box, uninterrupted) < 1e-6
    unserved = torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.1)  # upstream's own, unported
    _train(unserved, 3)
    box = _nvidia_box_adam(_params())
    box.load_state_dict(copy.deepcopy(unserved.state_dict()))
    _same_params(box, unserved)
    _train(unserved, 2)
    _train(box, 2)
    assert _apart(box, unserved) > 1e-3  # bias correction restarted at step 1
    assert capsys.readouterr().out.count("> ROCm port: torch's Adam writes its step into its param groups") == 1


def _steps_on_as_the_box(resumed, saved, box) -> None:
    """``resumed`` loads the box's ``saved`` state after its 3 steps and takes 2 more as the box does."""
    resumed.load_state_dict(saved)
    _same_params(resumed, box)
    _train(box, 2)
    _train(resumed, 2)
    assert _apart(resumed, box) < 1e-6
    assert {s["step"].item() for s in resumed.state.values()} == {5.0}


def test_torch_adam_resumes_an_nvidia_boxs_checkpoint(rp):
    box = _nvidia_box_adam(_params())
    _train(box, 3)
    saved = copy.deepcopy(box.state_dict())
    assert all("step" not in s for s in saved["state"].values())
    with pytest.raises(KeyError, match="step"):  # unported: torch's Adam asks each parameter's state
        unserved = torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.1)
        unserved.load_state_dict(box.state_dict())
        _train(unserved, 1)
    resumed = _wrapped(rp, torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.1))
    _steps_on_as_the_box(resumed, saved, box)


def _common_step_restored(saved):
    """Upstream from 2024-07-10 on (one rank): the checkpoint's one ``common_step`` (None where
    apex's FusedAdam wrote it: apex keeps no step per parameter) put into every parameter's state."""
    common = {float(s["step"]) for s in saved["state"].values() if s.get("step") is not None}
    restored = copy.deepcopy(saved)
    for state in restored["state"].values():
        state["step"] = common.pop() if common else None
    return restored


@pytest.mark.parametrize("resumer", ["fused", "torch"])
def test_an_apex_checkpoints_common_step_none_takes_the_groups(rp, resumer):
    """core 0.9 772faca1: the ported tree resuming a one-rank checkpoint an apex box wrote failed
    in torch's Adam ``__setstate__`` (``float(None)``): the restored common step is None."""
    box = _nvidia_box_adam(_params())
    _train(box, 3)
    saved = _common_step_restored(box.state_dict())
    with pytest.raises(TypeError, match="NoneType"):  # unported: torch's Adam reads the None
        torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.1).load_state_dict(copy.deepcopy(saved))
    resumed = (rp.FusedAdam(_params(), lr=0.1, weight_decay=0.1) if resumer == "fused"
               else _wrapped(rp, torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.1)))
    _steps_on_as_the_box(resumed, saved, box)


def test_the_ports_fused_adam_is_not_hooked_twice(rp):
    fused = _wrapped(rp, rp.FusedAdam(_params(), lr=0.1))
    assert not fused._optimizer_state_dict_post_hooks and not getattr(fused, "_rocm_port", False)
