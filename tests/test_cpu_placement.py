"""The CPU launcher's device placement reaches the backward of upstream's autograd functions.

Autograd calls a Python function's backward without the caller's TorchFunctionMode, so a GPU
placement there (the fork's CheckpointFunction.backward compares with
``torch.tensor(0).to(get_accelerator().device_name())``, 'cuda') escaped the placement mode.
"""

from __future__ import annotations

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
