"""The CPU substitutions: install and undo leave torch exactly as it was, installing twice changes
nothing, and the placement reaches the backward of upstream's autograd functions.

Autograd calls a Python function's backward without the caller's TorchFunctionMode, so a GPU
placement there (the fork's CheckpointFunction.backward compares with
``torch.tensor(0).to(get_accelerator().device_name())``, 'cuda') escaped the placement mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from megaport import cpu_substitutions  # noqa: E402
from megaport.train import hooks  # noqa: E402


def _owners() -> dict:
    """Everything a row replaces attributes of (the megatron and DeepSpeed rows' owners excepted)."""
    return {"torch.cuda": torch.cuda, "torch.cuda.random": torch.cuda.random, "torch.cuda.nvtx": torch.cuda.nvtx,
            "torch.Tensor": torch.Tensor, "torch.distributed": torch.distributed,
            "distributed_c10d": torch.distributed.distributed_c10d,
            "BackwardCFunction": torch.autograd.function.BackwardCFunction}


def _snapshot() -> dict:
    """Each owner's own attributes, by identity."""
    return {label: {name: id(value) for name, value in vars(owner).items()} for label, owner in _owners().items()}


def _changed(before: dict, after: dict) -> list:
    return sorted(f"{label}.{name}" for label in before for name in set(before[label]) | set(after[label])
                  if before[label].get(name) != after[label].get(name))


TORCH_PROFILES = ("training", "placement-mode", "placement", "process-group")


@pytest.fixture
def clean():
    """Nothing applied before the test, and nothing left after it."""
    assert not cpu_substitutions._APPLIED
    yield
    cpu_substitutions.undo()


def test_every_row_says_why_in_one_line():
    for name in cpu_substitutions.REGISTRY:
        assert cpu_substitutions.why(name), name
    named = {row for profile in cpu_substitutions.PROFILES.values() for row in profile.rows}
    assert named == set(cpu_substitutions.REGISTRY)


def test_install_then_undo_leaves_torch_exactly_as_it_was(clean):
    before = _snapshot()
    originals = {name: getattr(torch.cuda, name) for name in ("is_available", "current_device", "Event",
                                                             "FloatTensor", "manual_seed", "default_generators")}
    tensor_cuda, init = torch.Tensor.cuda, torch.distributed.init_process_group
    installed = cpu_substitutions.install(torch, *TORCH_PROFILES)
    assert _changed(before, _snapshot())  # it did replace things
    assert torch.cuda.current_device() == "cpu" and torch.cuda.FloatTensor is torch.FloatTensor
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.zeros(1, device="cuda").device.type == "cpu"  # the placement mode is on
    assert installed.rows and installed.lines
    cpu_substitutions.undo()
    assert _changed(before, _snapshot()) == []
    assert {name: getattr(torch.cuda, name) for name in originals} == originals
    assert all(getattr(torch.cuda, name) is value for name, value in originals.items())
    assert torch.Tensor.cuda is tensor_cuda and torch.distributed.init_process_group is init
    assert "cuda" not in vars(torch.Tensor)  # torch's own method again, not a copy of it
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")  # the placement mode is off


def test_an_installation_undoes_what_it_applied_and_leaves_the_rest(clean):
    before = _snapshot()
    cpu_substitutions.install(torch, "process-group")
    gloo = torch.distributed.init_process_group
    with cpu_substitutions.install(torch, "training") as training:
        assert "gloo" not in training.rows  # applied before: left to whoever applied it
        assert torch.cuda.is_available()
    assert torch.distributed.init_process_group is gloo
    assert _changed(before, _snapshot()) == ["distributed_c10d.new_group", "torch.distributed.init_process_group",
                                             "torch.distributed.new_group"]


def test_installing_twice_changes_nothing(clean):
    before = _snapshot()
    first = cpu_substitutions.install(torch, "training", "placement")
    once = _snapshot()
    second = cpu_substitutions.install(torch, "training", "placement")
    assert _snapshot() == once
    assert second.rows == [] and second.lines == first.lines
    second.undo()
    assert _snapshot() == once  # the second installation applied nothing, so takes back nothing
    cpu_substitutions.undo()
    assert _changed(before, _snapshot()) == []


def test_a_row_that_fails_part_way_is_taken_back(clean, monkeypatch):
    before = _snapshot()

    def half(patch, torch):
        patch.set(torch.cuda, "current_device", lambda: "cpu")
        raise RuntimeError("half way")

    monkeypatch.setitem(cpu_substitutions.REGISTRY, "current-device", half)
    with pytest.raises(RuntimeError, match="half way"):
        cpu_substitutions.install(torch, "placement")
    cpu_substitutions.undo()
    assert _changed(before, _snapshot()) == []


def test_the_profiles_for_fork_trees_need_the_tree(clean):
    with pytest.raises(TypeError, match="tree="):
        cpu_substitutions.install(torch, "fork-checks")


def test_deepspeed_s_after_import_step_is_taken_back(clean, tmp_path):
    """The DeepSpeed row waits for deepspeed.accelerator's import; undo takes the waiting step back."""
    (tmp_path / "pretrain_gpt.py").write_text("import deepspeed\n")
    finders = list(sys.meta_path)
    installed = cpu_substitutions.install(torch, "deepspeed", tree=tmp_path)
    assert installed.rows == ["deepspeed-accelerator"] and "DeepSpeed's CUDA accelerator" in installed.lines[0]
    assert any(getattr(f, "fullname", None) == "deepspeed.accelerator" for f in sys.meta_path)
    cpu_substitutions.undo()
    assert sys.meta_path == finders


def test_forget_leaves_the_other_steps_for_the_module():
    def first(module):
        pass

    def second(module):
        pass

    hooks.after_import("megaport_test_nothing", first)
    hooks.after_import("megaport_test_nothing", second)
    hooks.forget("megaport_test_nothing", first)
    finders = [f for f in sys.meta_path if getattr(f, "fullname", None) == "megaport_test_nothing"]
    assert [f.steps for f in finders] == [[second]]
    hooks.forget("megaport_test_nothing", second)
    assert not any(getattr(f, "fullname", None) == "megaport_test_nothing" for f in sys.meta_path)


def test_before_import_steps_run_before_the_modules_own_code(tmp_path, monkeypatch):
    (tmp_path / "megaport_test_names.py").write_text("built = Declared()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def declare(module):
        module.Declared = lambda: "declared"
        seen.append("before")

    def after(module):
        seen.append(module.built)

    hooks.after_import("megaport_test_names", after)
    hooks.before_import("megaport_test_names", declare)
    try:
        import megaport_test_names

        assert megaport_test_names.built == "declared" and seen == ["before", "declared"]
    finally:
        hooks.forget("megaport_test_names", declare)
        hooks.forget("megaport_test_names", after)
        sys.modules.pop("megaport_test_names", None)
    assert not any(getattr(f, "fullname", None) == "megaport_test_names" for f in sys.meta_path)


class _Placements(torch.overrides.TorchFunctionMode):
    seen: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            self.seen.append(args[1:])
        return func(*args, **(kwargs or {}))


def _placing_in_backward(device: str):
    """An autograd function (times 2) whose backward places a tensor on ``device``, as upstream's do."""

    class PlacesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.tensor(2.0).to(device)

    return PlacesInBackward


@pytest.fixture
def patch():
    patch = cpu_substitutions.Patch()
    yield patch
    patch.undo()


def _backward_under_mode():
    _Placements.seen = []
    x = torch.ones(3, requires_grad=True)
    with _Placements():
        _placing_in_backward("cpu").apply(x).sum().backward()
    return x.grad, list(_Placements.seen)


def test_without_it_the_mode_misses_placements_in_backward():
    grad, seen = _backward_under_mode()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen == []  # what the launcher had to mend: autograd drops the mode


def test_backward_runs_under_a_fresh_placement_mode(patch):
    cpu_substitutions.placement_in_backward(patch, torch, _Placements)
    grad, seen = _backward_under_mode()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen == [("cpu",)]


def test_the_placement_mode_keeps_a_cuda_placement_in_backward_on_the_cpu(clean):
    cpu_substitutions.install(torch, "training")  # its backward-placement row
    x = torch.ones(2, requires_grad=True)
    _placing_in_backward("cuda").apply(x).sum().backward()
    assert x.grad.device.type == "cpu" and torch.equal(x.grad, torch.full((2,), 2.0))


def test_the_placement_mode_drops_pin_memory(clean):
    """Upstream's get_pos_emb_on_this_cp_rank pins its index tensor (no driver to pin with here)."""
    with cpu_substitutions.placement_mode(torch):
        index = torch.tensor([0, 3], device="cpu", pin_memory=True)
    assert index.device.type == "cpu" and index.tolist() == [0, 3]


_FORK_MODULE = '''
import torch

_FLOAT_TYPES = [torch.cuda.FloatTensor(0).dtype]
_HALF_TYPES = [torch.cuda.HalfTensor(0).dtype]
'''


def _import_fork_module(tmp_path, pretrain_source: str):
    """A tree whose module builds CUDA tensors at import, as the fork's megatron/model/module.py
    (2023-12 … 2024-04) does through DeepSpeed's accelerator, imported after the smoke suite's
    CPU substitution for that tree: (returncode, output)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text(pretrain_source)
    (tree / "fork_module.py").write_text(_FORK_MODULE)
    code = textwrap.dedent(f"""
        import sys, torch
        from megaport import cpu_substitutions
        print("substituted:", cpu_substitutions.install(torch, "fork-checks", tree={str(tree)!r}).lines or None)
        print("cpu constructors:", torch.cuda.FloatTensor is torch.FloatTensor)
        sys.path.insert(0, {str(tree)!r})
        import fork_module
        print("types:", fork_module._FLOAT_TYPES, fork_module._HALF_TYPES)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return proc.returncode, proc.stdout + proc.stderr


def test_a_fork_tree_s_import_time_cuda_tensors_are_built_on_the_cpu_in_the_checks(tmp_path):
    code, out = _import_fork_module(tmp_path, "import deepspeed\n")
    assert code == 0, out
    assert "types: [torch.float32] [torch.float16]" in out
    assert "cpu constructors: True" in out
    assert "legacy constructors build CPU tensors" in out


def test_an_upstream_tree_keeps_torch_s_cuda_constructors(tmp_path):
    """Nothing is substituted for upstream trees: torch.cuda's constructors stay torch's."""
    _, out = _import_fork_module(tmp_path, "import torch\n")
    assert "substituted: None" in out
    assert "cpu constructors: False" in out
