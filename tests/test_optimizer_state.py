"""What the port serves upstream's distributed optimizer of torch's Adam (rocm_port's
``optimizer_state``): its ``step`` before the first step, and after a resume each parameter's own
step, the checkpoint's. The class below keeps upstream main's lines for an optimizer without apex
or TE (``HAVE_APEX_OR_TE`` False), reduced to the step; the whole run is in
``megaport verify --checks resume`` (dp2-distopt)."""

from __future__ import annotations

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


def _module(have_apex_or_te: bool = False):
    module = types.ModuleType(MODULE)
    module.HAVE_APEX_OR_TE = have_apex_or_te
    module.DistributedOptimizer = type("DistributedOptimizer", (_UpstreamDistributedOptimizer,), {})
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
    assert "> ROCm port: the distributed optimizer's resume left torch's Adam" in capsys.readouterr().out


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
