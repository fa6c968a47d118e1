"""The CPU launcher's device placement reaches the backward of upstream's autograd functions.

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

from megaport.train import cpu  # noqa: E402


class _Placements(torch.overrides.TorchFunctionMode):
    seen: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            self.seen.append(args[1:])
        return func(*args, **(kwargs or {}))


class _PlacesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        torch.tensor(0).to("cpu")
        return grad * 2


@pytest.fixture
def restore_backward():
    real = torch.autograd.function.BackwardCFunction.apply
    yield
    torch.autograd.function.BackwardCFunction.apply = real


def _backward_under_mode():
    _Placements.seen = []
    x = torch.ones(3, requires_grad=True)
    with _Placements():
        _PlacesInBackward.apply(x).sum().backward()
    return x.grad, list(_Placements.seen)


def test_without_it_the_mode_misses_placements_in_backward(restore_backward):
    grad, seen = _backward_under_mode()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen == []  # what the launcher had to mend: autograd drops the mode


def test_backward_runs_under_a_fresh_placement_mode(restore_backward):
    cpu.placement_in_backward(torch, _Placements)
    grad, seen = _backward_under_mode()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen == [("cpu",)]


def test_the_placement_mode_keeps_a_cuda_placement_in_backward_on_the_cpu(restore_backward):
    cpu.placement_in_backward(torch, lambda: cpu.placement_mode(torch))

    class ToCuda(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.tensor(3.0).to("cuda")

    x = torch.ones(2, requires_grad=True)
    ToCuda.apply(x).sum().backward()
    assert x.grad.device.type == "cpu" and torch.equal(x.grad, torch.full((2,), 3.0))


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
        from megaport.deepspeed_fork import install_cpu_check_substitution
        print("substituted:", install_cpu_check_substitution({str(tree)!r}, torch))
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
