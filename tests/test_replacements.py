"""Tests for the code megaport injects into upstream trees (the package megatron/core/rocm_port).

The package is loaded from its source folder under a unique name, the way upstream will
import it, and checked against references written here independently: plain fp64
math for the softmax kernels, torch.nn.LayerNorm for layer norm, and hand-computed
tables for get_batch_per_block.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import megaport.replacements as replacements  # noqa: E402
from support.port import SOURCE  # noqa: E402
from support.port import load as _load  # noqa: E402
from support.upstream_shapes import HF_WRAPPER_2025  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCALES = [1.0, 0.125]
# Largest error allowed, relative to the largest magnitude of the reference: the
# kernels' own tests use 1e-3 for fp16; bf16 has 8 significant bits, so one rounding
# of the output is already 2e-3 of an element.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.float64: 1e-12}


@pytest.fixture(scope="module")
def rp():
    module = _load(None)
    yield module
    module.uninstall_import_blocker()


@pytest.fixture(scope="module")
def rp_old(rp, tmp_path_factory):
    """The package rendered for eras before fully masked rows became zeros."""
    files = replacements.render(fully_masked_rows_are_zero=False)
    module = _load(files, tmp_path_factory.mktemp("rendered"))
    yield module
    module.uninstall_import_blocker()


# ----------------------------------------------------------------------------------
# fp64 references (independent of the module)
# ----------------------------------------------------------------------------------


def ref_softmax(x, scale, mask=None, causal=False, fully_masked_rows_are_zero=True):
    """The kernels' forward in fp64 from the (already rounded) input values."""
    z = x.double() * scale
    if causal:
        sq, sk = z.shape[-2], z.shape[-1]
        future = torch.arange(sk)[None, :] > torch.arange(sq)[:, None]
        z = z.masked_fill(future, -math.inf)
    elif mask is not None:
        z = torch.where(mask, torch.tensor(-10000.0, dtype=torch.float64), z)
    if z.numel() == 0:
        return z
    m = z.max(-1, keepdim=True).values
    e = torch.exp(z - m)
    y = e / e.sum(-1, keepdim=True)
    if mask is not None and not causal and fully_masked_rows_are_zero:
        y = torch.where(m == -10000.0, torch.zeros_like(y), y)
    return y


def ref_backward(g, y, scale):
    """dx = scale * (y*g - y*sum(y*g)) in fp64, from the saved (rounded) output."""
    g = g.double()
    y = y.double()
    return scale * (y * g - y * (y * g).sum(-1, keepdim=True))


def backward_size(g, y, scale):
    """The magnitude of the terms the backward formula subtracts (its rounding scale)."""
    g = g.double()
    y = y.double()
    if y.numel() == 0:
        return 0.0
    terms = y.abs() * (g.abs() + (y * g).abs().sum(-1, keepdim=True))
    return abs(scale) * terms.max().item()


def assert_close(actual, ref, dtype, what="", size=None):
    """Max error at most TOL[dtype] times ``size`` (default: the reference's magnitude)."""
    assert actual.dtype == dtype, what
    assert actual.shape == ref.shape, what
    if ref.numel() == 0:
        return
    err = (actual.double() - ref).abs().max().item()
    size = ref.abs().max().item() if size is None else size
    assert err <= TOL[dtype] * max(size, 1e-30), f"{what}: max error {err:.3g} vs scale {size:.3g}"


def run_forward_backward(fn, x, *args):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x, *args)
    g = torch.randn(y.shape, dtype=torch.float64).to(y.dtype)
    y.backward(g)
    return y.detach(), g, x.grad


def random_mask(shape, p=0.3, generator=None):
    return torch.rand(shape, generator=generator) < p


# ----------------------------------------------------------------------------------
# Softmax: forward and backward against the references
# ----------------------------------------------------------------------------------

MASKED_CASES = [
    # (input shape, mask shape)
    ((2, 3, 5, 7), (2, 1, 5, 7)),  # per-batch mask, sizes not divisible by 4
    ((2, 3, 5, 7), (1, 1, 5, 7)),  # mask broadcast over the batch
    ((2, 2, 4, 8), (2, 1, 4, 8)),
    ((1, 1, 2, 4100), (1, 1, 2, 4100)),  # sk beyond the kernel's 4096
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("shape,mask_shape", MASKED_CASES, ids=str)
def test_masked_softmax_matches_reference(rp, dtype, scale, shape, mask_shape):
    torch.manual_seed(1)
    x = (torch.randn(shape, dtype=torch.float64) * 4).to(dtype)
    mask = random_mask(mask_shape)
    y, g, dx = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x, mask, scale)
    assert_close(y, ref_softmax(x, scale, mask), dtype, "forward")
    assert_close(dx, ref_backward(g, y, scale), dtype, "backward", backward_size(g, y, scale))


CAUSAL_SHAPES = [(3, 5, 5), (3, 5, 7), (3, 7, 5), (2, 3, 6, 6), (1, 2, 4100), (4, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=str)
def test_causal_softmax_matches_reference(rp, dtype, scale, shape):
    torch.manual_seed(2)
    x = (torch.randn(shape, dtype=torch.float64) * 4).to(dtype)
    y, g, dx = run_forward_backward(rp.ScaledUpperTriangMaskedSoftmax.apply, x, scale)
    assert_close(y, ref_softmax(x, scale, causal=True), dtype, "forward")
    assert_close(dx, ref_backward(g, y, scale), dtype, "backward", backward_size(g, y, scale))


PLAIN_SHAPES = [(2, 3, 5, 7), (1, 1, 2, 4100), (5, 7), (7,), (2, 2, 2, 3, 5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("shape", PLAIN_SHAPES, ids=str)
def test_plain_softmax_matches_reference(rp, dtype, scale, shape):
    torch.manual_seed(3)
    x = (torch.randn(shape, dtype=torch.float64) * 4).to(dtype)
    y, g, dx = run_forward_backward(rp.ScaledSoftmax.apply, x, scale)
    assert_close(y, ref_softmax(x, scale), dtype, "forward")
    assert_close(dx, ref_backward(g, y, scale), dtype, "backward", backward_size(g, y, scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_softmax_without_mask_is_plain_softmax(rp, dtype):
    torch.manual_seed(4)
    x = torch.randn(2, 3, 5, 7).to(dtype)
    y, g, dx = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x, None, 0.125)
    assert_close(y, ref_softmax(x, 0.125), dtype, "forward")
    assert_close(dx, ref_backward(g, y, 0.125), dtype, "backward", backward_size(g, y, 0.125))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_input_and_grad(rp, dtype):
    torch.manual_seed(5)
    x = torch.randn(2, 3, 7, 5).to(dtype).transpose(-1, -2)
    mask = random_mask((2, 1, 5, 7))
    y, _, _ = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x, mask, 0.5)
    assert_close(y, ref_softmax(x, 0.5, mask), dtype, "forward")
    xr = x.detach().clone().requires_grad_(True)
    y = rp.ScaledUpperTriangMaskedSoftmax.apply(xr, 0.5)
    g = torch.randn(7, 5, 2, 3).to(dtype).permute(2, 3, 1, 0)
    y.backward(g)
    assert_close(xr.grad, ref_backward(g, y.detach(), 0.5), dtype, "backward",
                 backward_size(g, y.detach(), 0.5))


def test_backward_includes_the_scale(rp):
    """A replacement that forgot the scale in backward would be 8x off here."""
    torch.manual_seed(6)
    x = torch.randn(2, 2, 4, 6)
    for fn, args in [
        (rp.ScaledSoftmax.apply, (0.125,)),
        (rp.ScaledUpperTriangMaskedSoftmax.apply, (0.125,)),
        (rp.ScaledMaskedSoftmax.apply, (random_mask((2, 1, 4, 6)), 0.125)),
    ]:
        y, g, dx = run_forward_backward(fn, x, *args)
        ref = ref_backward(g, y, 0.125)
        assert_close(dx, ref, torch.float32, "backward", backward_size(g, y, 0.125))
        unscaled = (dx.double() * 8 - ref).abs().max().item()
        assert unscaled > 100 * TOL[torch.float32] * ref.abs().max().item()


def test_grad_of_sum_through_expanded_grad(rp):
    """sum().backward() hands backward a stride-0 gradient."""
    x = torch.randn(2, 3, 4, requires_grad=True)
    rp.ScaledUpperTriangMaskedSoftmax.apply(x, 0.5).sum().backward()
    # Rows of a softmax sum to one, so the gradient of the sum is zero.
    assert x.grad.abs().max().item() < 1e-6


@settings(max_examples=40, deadline=None)
@given(
    dims=st.tuples(*(st.integers(1, 3),) * 2, st.integers(1, 9), st.integers(1, 9)),
    per_batch=st.booleans(),
    scale=st.sampled_from([1.0, 0.5, 0.125, 0.0884]),
    seed=st.integers(0, 2**31 - 1),
)
def test_masked_softmax_property(rp, dims, per_batch, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    b, np_, sq, sk = dims
    x = torch.randn(dims, generator=gen, dtype=torch.float64).float() * 3
    mask = random_mask((b if per_batch else 1, 1, sq, sk), p=0.4, generator=gen)
    y, g, dx = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x, mask, scale)
    assert_close(y, ref_softmax(x, scale, mask), torch.float32, "forward")
    size = backward_size(g, y, scale)
    assert_close(dx, ref_backward(g, y, scale), torch.float32, "backward", size)


# ----------------------------------------------------------------------------------
# Softmax: kernel-specific semantics
# ----------------------------------------------------------------------------------


def _mask_with_dead_row():
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1, :] = True  # row 1 fully masked
    mask[0, 0, 2, 1:4] = True  # row 2 partly masked
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_are_zero(rp, dtype):
    assert rp.FULLY_MASKED_ROWS_ARE_ZERO is True
    torch.manual_seed(7)
    x = torch.randn(2, 2, 3, 5).to(dtype)
    y, g, dx = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x, _mask_with_dead_row(), 0.125)
    assert torch.equal(y[:, :, 1], torch.zeros_like(y[:, :, 1]))
    assert torch.equal(dx[:, :, 1], torch.zeros_like(dx[:, :, 1]))
    # Rows with finite unmasked entries are ordinary softmaxes over those entries.
    assert_close(y, ref_softmax(x, 0.125, _mask_with_dead_row()), dtype, "forward")
    live = ref_softmax(x[:, :, 2][..., [0, 4]], 0.125)
    assert_close(y[:, :, 2][..., [0, 4]], live, dtype, "partly masked row")
    assert torch.equal(y[:, :, 2, 1:4], torch.zeros_like(y[:, :, 2, 1:4]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_are_uniform_in_old_eras(rp_old, dtype):
    assert rp_old.FULLY_MASKED_ROWS_ARE_ZERO is False
    torch.manual_seed(7)
    x = torch.randn(2, 2, 3, 5).to(dtype)
    mask = _mask_with_dead_row()
    y, g, dx = run_forward_backward(rp_old.ScaledMaskedSoftmax.apply, x, mask, 0.125)
    uniform = torch.full_like(y[:, :, 1], 0.2, dtype=torch.float64)
    assert_close(y[:, :, 1], uniform, dtype, "dead row")
    assert_close(y, ref_softmax(x, 0.125, mask, fully_masked_rows_are_zero=False), dtype, "forward")
    assert_close(dx, ref_backward(g, y, 0.125), dtype, "backward", backward_size(g, y, 0.125))


def test_row_whose_maximum_is_the_mask_value_is_zeroed(rp, rp_old):
    """The kernel tests the row maximum, not the mask: unmasked values below -10000 count."""
    x = torch.tensor([[[[-20000.0, 1.0, -30000.0]]]])
    mask = torch.tensor([[[[False, True, False]]]])
    assert torch.equal(rp.ScaledMaskedSoftmax.apply(x, mask, 1.0), torch.zeros(1, 1, 1, 3))
    y_old = rp_old.ScaledMaskedSoftmax.apply(x, mask, 1.0)
    assert torch.equal(y_old, torch.tensor([[[[0.0, 1.0, 0.0]]]]))


def test_masked_value_is_not_scaled(rp):
    """Masked entries are -10000.0 itself, not -10000.0 * scale: visible near -10000."""
    x = torch.tensor([[[[-79990.0, 0.0]]]], dtype=torch.float64)
    mask = torch.tensor([[[[False, True]]]])
    y = rp.ScaledMaskedSoftmax.apply(x, mask, 0.125)  # -9998.75 vs -10000.0
    e = math.exp(-1.25)
    assert torch.allclose(y, torch.tensor([[[[1 / (1 + e), e / (1 + e)]]]], dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 6, 6), (2, 5, 9), (2, 9, 5)], ids=str)
def test_causal_future_positions_are_exactly_zero(rp, dtype, shape):
    torch.manual_seed(8)
    x = (torch.randn(shape) * 50).to(dtype)
    y = rp.ScaledUpperTriangMaskedSoftmax.apply(x, 1.0)
    sq, sk = shape[-2:]
    future = torch.arange(sk)[None, :] > torch.arange(sq)[:, None]
    assert (y[..., future] == 0.0).all()
    assert y[..., 0, 0].eq(1.0).all()


@pytest.mark.parametrize(
    "fn,extra",
    [
        ("ScaledSoftmax", ()),
        ("ScaledUpperTriangMaskedSoftmax", ()),
        ("ScaledMaskedSoftmax", ("mask",)),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_output_dtype_is_input_dtype(rp, fn, extra, dtype):
    x = torch.randn(2, 2, 3, 4).to(dtype).requires_grad_(True)
    args = [random_mask((2, 1, 3, 4))] if extra else []
    y = getattr(rp, fn).apply(x, *args, 0.5)
    assert y.dtype == dtype
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == dtype


@pytest.mark.parametrize(
    "shape", [(0, 2, 3, 4), (2, 0, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_empty_dimensions(rp, shape, dtype):
    x = torch.randn(shape).to(dtype)
    mask = torch.zeros((1, 1) + shape[2:], dtype=torch.bool)
    for fn, args in [
        (rp.ScaledSoftmax.apply, (0.5,)),
        (rp.ScaledUpperTriangMaskedSoftmax.apply, (0.5,)),
        (rp.ScaledMaskedSoftmax.apply, (mask, 0.5)),
    ]:
        y, g, dx = run_forward_backward(fn, x, *args)
        assert y.shape == shape and y.dtype == dtype
        assert dx.shape == shape and dx.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [1, 16, 40, 100])
def test_cpu_blocking_does_not_change_results(rp, monkeypatch, dtype, block):
    """Results are bitwise the same whatever the CPU block size (both blocking modes)."""
    torch.manual_seed(9)
    x = torch.randn(3, 4, 5, 7).to(dtype)
    mask = random_mask((3, 1, 5, 7))
    mask[1, 0, 2] = True  # a fully masked row
    g = torch.randn(3, 4, 5, 7).to(dtype)

    def everything():
        results = []
        for fn, args in [
            (rp.ScaledSoftmax.apply, (0.3,)),
            (rp.ScaledUpperTriangMaskedSoftmax.apply, (0.3,)),
            (rp.ScaledMaskedSoftmax.apply, (mask, 0.3)),
        ]:
            xr = x.clone().requires_grad_(True)
            y = fn(xr, *args)
            y.backward(g)
            results += [y.detach(), xr.grad]
        return results

    monkeypatch.setattr(rp.softmax, "_CPU_BLOCK_ELEMENTS", 10**9)
    whole = everything()
    monkeypatch.setattr(rp.softmax, "_CPU_BLOCK_ELEMENTS", block)
    monkeypatch.setattr(rp.softmax, "_block_elements", lambda device, numel: block)
    for a, b in zip(whole, everything()):
        assert torch.equal(a, b)


def test_fallback_without_inplace_kernels(rp, monkeypatch):
    """The allocating path (old torch, or an overlap check) gives the same results."""
    torch.manual_seed(10)
    x = torch.randn(2, 3, 5, 7).bfloat16()
    mask = random_mask((2, 1, 5, 7))
    fast = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x, mask, 0.125)
    monkeypatch.setattr(rp.softmax, "_inplace_kernels_ok", lambda device: False)
    torch.manual_seed(10)
    x2 = torch.randn(2, 3, 5, 7).bfloat16()
    slow = run_forward_backward(rp.ScaledMaskedSoftmax.apply, x2, mask, 0.125)
    assert_close(slow[0], fast[0].double(), torch.bfloat16)
    assert_close(slow[2], ref_backward(slow[1], slow[0], 0.125), torch.bfloat16, "backward",
                 backward_size(slow[1], slow[0], 0.125))


def test_inplace_kernels_are_used_on_this_torch(rp):
    assert rp.softmax._inplace_kernels_ok(torch.device("cpu")) is True


def test_rejects_integer_input(rp):
    with pytest.raises(TypeError):
        rp.ScaledSoftmax.apply(torch.ones(2, 3, dtype=torch.int64), 1.0)


@pytest.mark.parametrize("which", ["plain", "causal", "masked"])
def test_gradcheck_fp64(rp, which):
    torch.manual_seed(11)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    if which == "plain":
        fn = lambda t: rp.ScaledSoftmax.apply(t, 0.7)  # noqa: E731
    elif which == "causal":
        fn = lambda t: rp.ScaledUpperTriangMaskedSoftmax.apply(t, 0.7)  # noqa: E731
    else:
        mask = random_mask((2, 1, 4, 5))
        mask[..., 0] = False  # every row keeps an entry
        fn = lambda t: rp.ScaledMaskedSoftmax.apply(t, mask, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("which", ["plain", "causal", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_only_the_output_is_saved_for_backward(rp, which, dtype):
    x = torch.randn(2, 3, 4, 4).to(dtype).requires_grad_(True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if which == "plain":
            y = rp.ScaledSoftmax.apply(x, 0.5)
        elif which == "causal":
            y = rp.ScaledUpperTriangMaskedSoftmax.apply(x, 0.5)
        else:
            y = rp.ScaledMaskedSoftmax.apply(x, random_mask((2, 1, 4, 4)), 0.5)
    assert len(packed) == 1
    assert packed[0].data_ptr() == y.data_ptr() and packed[0].dtype == dtype
    assert len(y.grad_fn.saved_tensors) == 1
    assert isinstance(y.grad_fn.scale, float)


# ----------------------------------------------------------------------------------
# get_batch_per_block
# ----------------------------------------------------------------------------------

# (sk, WARP, expected): pow2 = next power of two >= sk; warp = min(pow2, WARP);
# batches_per_warp = 2 if pow2 <= 128 else 1; (128 // warp) * batches_per_warp.
BATCH_PER_BLOCK = [
    (1024, 32, 4),  # warp 32, bpw 1, 4 warps
    (1024, 64, 2),  # warp 64, bpw 1, 2 warps
    (4096, 32, 4),
    (16384, 64, 2),
    (129, 64, 2),  # pow2 256
    (128, 64, 4),  # warp 64, bpw 2, 2 warps
    (128, 32, 8),  # warp 32, bpw 2, 4 warps
    (100, 32, 8),  # pow2 128
    (16, 32, 16),  # warp 16, bpw 2, 8 warps
    (16, 64, 16),
    (3, 32, 64),  # pow2 4: warp 4, 32 warps, bpw 2
    (1, 32, 256),  # pow2 1: warp 1, 128 warps, bpw 2
    (0, 64, 256),
]


@pytest.mark.parametrize("sk,warp,expected", BATCH_PER_BLOCK)
def test_get_batch_per_block(rp, sk, warp, expected):
    assert rp.get_batch_per_block(7, sk, 3, 5, warp=warp) == expected


def test_warp_size_defaults(rp, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert rp.warp_size() == 32
    assert rp.get_batch_per_block(1024, 1024, 1, 1) == 4
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert rp.warp_size() == 64
    assert rp.get_batch_per_block(1024, 1024, 1, 1) == 2


# ----------------------------------------------------------------------------------
# Import blocker
# ----------------------------------------------------------------------------------


@pytest.fixture()
def fake_packages(tmp_path, monkeypatch):
    """Importable apex / amp_C / *_cuda stand-ins, as if apex were installed."""
    (tmp_path / "apex" / "normalization").mkdir(parents=True)
    (tmp_path / "apex" / "__init__.py").write_text("FAKE = True\n")
    (tmp_path / "apex" / "normalization" / "__init__.py").write_text("FAKE = True\n")
    (tmp_path / "amp_C.py").write_text("FAKE = True\n")
    (tmp_path / "scaled_masked_softmax_cuda.py").write_text("FAKE = True\n")
    (tmp_path / "not_blocked_cuda_helper.py").write_text("FAKE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ["apex", "apex.normalization", "amp_C", "scaled_masked_softmax_cuda",
                 "not_blocked_cuda_helper"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    yield tmp_path
    for name in ["apex", "apex.normalization", "amp_C", "scaled_masked_softmax_cuda",
                 "not_blocked_cuda_helper"]:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "name", ["apex", "apex.normalization", "amp_C", "scaled_masked_softmax_cuda",
             "fused_weight_gradient_mlp_cuda", "fused_layer_norm_cuda"]
)
def test_blocked_imports(rp, fake_packages, name):
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(name)
    top = name.partition(".")[0]
    if sys.modules.get(top, False) is not None:  # no absent mark (fake_packages took it): the finder refuses
        assert "disabled by the ROCm port" in str(info.value)
        assert "(megatron/core/rocm_port)" in str(info.value)
    # A submodule's import stops at its (blocked) parent package.
    assert info.value.name == name.partition(".")[0]


def test_blocker_refuses_submodules_itself(rp):
    finder = next(f for f in sys.meta_path if getattr(f, rp.blocker._BLOCKER_MARK, False))
    with pytest.raises(ModuleNotFoundError, match="apex.normalization.fused_layer_norm"):
        finder.find_spec("apex.normalization.fused_layer_norm", None)
    assert finder.find_spec("apexx", None) is None
    assert finder.find_spec("megatron.core.fused_cuda_helpers", None) is None


def test_import_statement_fallback_pattern(rp, fake_packages):
    try:
        import apex  # noqa: F401

        took = "apex"
    except ImportError:
        took = "torch"
    assert took == "torch"
    try:
        from apex.normalization import FusedLayerNorm  # noqa: F401
    except ImportError:
        took = "torch again"
    assert took == "torch again"
    import json  # noqa: F401
    import torch as torch_again  # noqa: F401

    importlib.import_module("not_blocked_cuda_helper")  # "_cuda" only counts at the end


def test_blocker_is_what_stops_the_fake_apex(rp, fake_packages):
    rp.uninstall_import_blocker()
    try:
        assert importlib.import_module("apex").FAKE is True
    finally:
        rp.install_import_blocker()
        sys.modules.pop("apex", None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("apex")


def test_blocker_install_is_idempotent(rp):
    def count():
        return sum(1 for f in sys.meta_path if getattr(f, rp.blocker._BLOCKER_MARK, False))

    assert count() == 1
    assert getattr(sys.meta_path[0], rp.blocker._BLOCKER_MARK, False)
    rp.install_import_blocker()
    rp.install_import_blocker()
    assert count() == 1


@pytest.mark.parametrize("name", ["apex", "amp_C", "scaled_masked_softmax_cuda"])
def test_a_probe_hears_not_installed_even_where_installed(rp, fake_packages, name):
    rp.install_import_blocker()  # fake_packages took the absent marks out with the modules
    assert importlib.util.find_spec(name) is None  # transformers' probe: "not installed", no exception
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    with pytest.raises(ModuleNotFoundError):
        importlib.util.find_spec(f"{name}.normalization")
    assert importlib.util.find_spec("not_blocked_cuda_helper") is not None


def test_uninstalling_takes_the_absent_marks_back(rp, fake_packages):
    rp.install_import_blocker()
    rp.uninstall_import_blocker()
    try:
        assert "apex" not in sys.modules and importlib.util.find_spec("apex") is not None
    finally:
        rp.install_import_blocker()
    assert sys.modules["apex"] is None


_TRANSFORMERS_ORDERS = {"port first": "import {port}; import transformers",
                        "transformers first": "import transformers; import {port}"}


@pytest.mark.parametrize("order", sorted(_TRANSFORMERS_ORDERS))
def test_transformers_imports_beside_the_port(order, tmp_path):
    """transformers probes apex at import (4.x eagerly, 5.x on first use); in a ported process
    it must hear "not installed" in either order, and its own check must say so."""
    pytest.importorskip("transformers")
    import subprocess

    (tmp_path / "rocm_port").symlink_to(SOURCE, target_is_directory=True)
    code = (_TRANSFORMERS_ORDERS[order].format(port="rocm_port") +
            "; from transformers.utils import is_apex_available; assert not is_apex_available()"
            "; import importlib.util; assert importlib.util.find_spec('apex') is None")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_blocked_modules_loaded(rp, monkeypatch):
    assert rp.blocked_modules_loaded() == []
    monkeypatch.setitem(sys.modules, "fused_layer_norm_cuda", object())
    monkeypatch.setitem(sys.modules, "apex.contrib", object())
    assert rp.blocked_modules_loaded() == ["apex.contrib", "fused_layer_norm_cuda"]


@pytest.mark.parametrize("file", replacements.module_files())
def test_module_imports_only_torch_and_the_standard_library(file):
    """At import time (megatron.core is still initialising then): torch, the standard library and the
    package's own modules, relatively (so it works at megatron/rocm_port too). The tree's own megatron
    package may only be imported lazily, inside a function, and so may NumPy (only to restore the
    names NumPy 2 removed, where it is installed)."""
    tree = ast.parse(replacements.source_text(file))
    roots = set()
    lazy = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for node in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name.partition(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.level == 1 and id(node) not in lazy, f"{file}: from {'.' * node.level}{node.module}"
                continue
            names = [node.module.partition(".")[0]]
        else:
            continue
        if id(node) in lazy and names in (["megatron"], ["numpy"]):
            continue
        roots.update(names)
    assert roots <= {"torch"} | set(sys.stdlib_module_names), roots


# ----------------------------------------------------------------------------------
# apex replacements
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fused_layer_norm_matches_torch(rp, memory_efficient):
    args = inspect.getfullargspec(rp.FusedLayerNormAffineFunction.forward).args
    assert "memory_efficient" in args
    torch.manual_seed(12)
    hidden = 10
    ln = torch.nn.LayerNorm(hidden, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(3, 4, hidden, dtype=torch.float64, requires_grad=True)
    w = ln.weight.detach().clone().requires_grad_(True)
    b = ln.bias.detach().clone().requires_grad_(True)
    y = rp.FusedLayerNormAffineFunction.apply(x, w, b, hidden, 1e-5, memory_efficient)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = ln(x_ref)
    assert torch.allclose(y, y_ref, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(w.grad, ln.weight.grad, atol=1e-12)
    assert torch.allclose(b.grad, ln.bias.grad, atol=1e-12)


def test_fused_layer_norm_mixed_dtypes(rp):
    x = torch.randn(4, 8).bfloat16()
    w = torch.ones(8)
    b = torch.zeros(8)
    y = rp.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-5)
    assert y.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(x.double(), (8,), eps=1e-5)
    assert (y.double() - ref).abs().max().item() < 2e-2


def test_fused_rms_norm(rp):
    assert "memory_efficient" in inspect.getfullargspec(rp.FusedRMSNormAffineFunction.forward).args
    torch.manual_seed(13)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = rp.FusedRMSNormAffineFunction.apply(x, w, 6, 1e-6)
    ref = x.detach() / torch.sqrt((x.detach() ** 2).mean(-1, keepdim=True) + 1e-6) * w.detach()
    assert torch.allclose(y, ref, atol=1e-12)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    yb = rp.FusedRMSNormAffineFunction.apply(x.detach().bfloat16(), w.detach().float(), (6,), 1e-6)
    assert yb.dtype == torch.bfloat16


def _ints(shape, gen):
    return torch.randint(-4, 5, shape, generator=gen).to(torch.float64)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wgrad_gemm_accum_fp32(rp, input_dtype):
    gen = torch.Generator().manual_seed(14)
    x = _ints((6, 7), gen)
    g = _ints((6, 5), gen)
    main = _ints((5, 7), gen)
    expected = (main + g.T @ x).float()  # small integers: every step is exact
    main_grad = main.float()
    ptr = main_grad.data_ptr()
    out = rp.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(
        x.to(input_dtype), g.to(input_dtype), main_grad
    )
    assert out is None
    assert main_grad.data_ptr() == ptr and main_grad.dtype == torch.float32
    assert torch.equal(main_grad, expected)


def test_wgrad_gemm_accum_flattens_leading_dims(rp):
    gen = torch.Generator().manual_seed(15)
    x = _ints((2, 3, 7), gen)
    g = _ints((2, 3, 5), gen)
    main_grad = torch.zeros(5, 7)
    rp.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x.bfloat16(), g.bfloat16(), main_grad)
    assert torch.equal(main_grad, (g.reshape(6, 5).T @ x.reshape(6, 7)).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wgrad_gemm_accum_fp16(rp, dtype):
    gen = torch.Generator().manual_seed(16)
    x = _ints((6, 7), gen)
    g = _ints((6, 5), gen)
    main = _ints((5, 7), gen)
    main_grad = main.to(dtype)
    rp.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x.to(dtype), g.to(dtype), main_grad)
    assert main_grad.dtype == dtype
    assert torch.equal(main_grad, (main + g.T @ x).to(dtype))


# ----------------------------------------------------------------------------------
# Distributed backend
# ----------------------------------------------------------------------------------


def test_resolve_distributed_backend(rp, capsys):
    assert rp.DISTRIBUTED_BACKENDS == ["nccl", "gloo", "rccl"]
    assert rp.resolve_distributed_backend("rccl", rank=1) == "nccl"
    assert rp.resolve_distributed_backend("nccl", rank=1) == "nccl"
    assert rp.resolve_distributed_backend("gloo") == "gloo"
    assert capsys.readouterr().out == ""
    for bad in ["mpi", "", "rccl2"]:
        with pytest.raises(ValueError, match="unknown distributed backend"):
            rp.resolve_distributed_backend(bad)


def test_default_distributed_backend(rp, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert rp.default_distributed_backend() == "nccl"
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert rp.default_distributed_backend() == "rccl"


def test_collective_library_never_raises(rp, monkeypatch):
    name, version = rp.collective_library()  # on CPU-only torch there is no NCCL
    assert name in ("NCCL", "RCCL")
    assert version is None or isinstance(version, str)

    def broken():
        raise RuntimeError("no NCCL in this build")

    monkeypatch.setattr(torch.cuda.nccl, "version", broken)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert rp.collective_library() == ("NCCL", None)


@pytest.mark.parametrize(
    "raw,text", [((2, 18, 3), "2.18.3"), (21805, "2.18.5"), (2708, "2.7.8")]
)
def test_collective_library_versions(rp, monkeypatch, raw, text):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: raw)
    assert rp.collective_library() == ("NCCL", text)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert rp.collective_library() == ("RCCL", text)


def test_rank0_logs_the_collective_library(rp, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 18, 3))
    assert rp.resolve_distributed_backend("rccl", rank=0) == "nccl"
    assert capsys.readouterr().out == (
        "> ROCm port: distributed backend 'rccl' -> torch 'nccl' (RCCL 2.18.3)\n"
    )
    rp.resolve_distributed_backend("rccl", rank=1)
    rp.resolve_distributed_backend("gloo", rank=0)
    assert capsys.readouterr().out == ""


def test_rank0_log_without_a_version(rp, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: None)
    rp.resolve_distributed_backend("nccl", rank=0)
    out = capsys.readouterr().out
    assert out == "> ROCm port: distributed backend 'nccl' -> torch 'nccl' (NCCL version unknown)\n"


# ----------------------------------------------------------------------------------
# The replacements package: source text, rendering, public names
# ----------------------------------------------------------------------------------


def test_source_and_render():
    files = replacements.module_files()
    assert files[0] == "__init__.py" and "era.py" in files and files == sorted(files)
    texts = replacements.sources()
    assert texts == {f: (SOURCE / f).read_text(encoding="utf-8") for f in files}
    assert replacements.TREE_PATH == "megatron/core/rocm_port"
    # the era constants live in era.py alone
    assert [f for f, text in texts.items() if "FULLY_MASKED_ROWS_ARE_ZERO = True" in text.splitlines()] == ["era.py"]
    assert replacements.render(fully_masked_rows_are_zero=True) == {f"megatron/core/rocm_port/{f}": texts[f] for f in files}
    old = replacements.render(fully_masked_rows_are_zero=False)
    changed = {path: [(a, b) for a, b in zip(texts[path.rpartition("/")[2]].splitlines(), text.splitlines()) if a != b]
               for path, text in old.items() if text != texts[path.rpartition("/")[2]]}
    assert changed == {"megatron/core/rocm_port/era.py": [("FULLY_MASKED_ROWS_ARE_ZERO = True",
                                                           "FULLY_MASKED_ROWS_ARE_ZERO = False")]}
    moved = replacements.render(fully_masked_rows_are_zero=True, tree_path="megatron/rocm_port")
    assert all(path.startswith("megatron/rocm_port/") for path in moved)
    assert "(megatron/rocm_port)" in moved["megatron/rocm_port/blocker.py"]
    assert not any("megatron/core/rocm_port" in text for text in moved.values())


def test_port_constant_reads_the_one_module_that_defines_it():
    assert replacements.port_constant("_BLOCKED_EXACT") == ("apex", "amp_C")
    assert replacements.port_constant("FULLY_MASKED_ROWS_ARE_ZERO") is True
    with pytest.raises(KeyError):
        replacements.port_constant("NO_SUCH_CONSTANT")


@pytest.mark.parametrize(
    "texts", [{"era.py": "x = 1\n"},
              {"era.py": "FULLY_MASKED_ROWS_ARE_ZERO = True\n", "softmax.py": "FULLY_MASKED_ROWS_ARE_ZERO = True\n"},
              {"era.py": "FULLY_MASKED_ROWS_ARE_ZERO = True  # comment\n"}]
)
def test_render_needs_the_line_exactly_once_in_the_package(monkeypatch, texts):
    monkeypatch.setattr(replacements, "sources", lambda: texts)
    with pytest.raises(ValueError, match="exactly once"):
        replacements.render(fully_masked_rows_are_zero=False)


def test_public_names(rp):
    for name in rp.__all__:
        assert hasattr(rp, name), name
    assert "megaport" in rp.__doc__ and "Do not edit" in rp.__doc__
    assert len(set(rp.__all__)) == len(rp.__all__)
    # every public name a module defines is the package's too (upstream imports them from it)
    for file in replacements.module_files()[1:]:
        module = getattr(rp, file[:-3])
        for node in ast.parse(replacements.source_text(file)).body:
            targets = [node] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                node.targets if isinstance(node, ast.Assign) else []
            for name in (getattr(target, "name", None) or getattr(target, "id", None) for target in targets):
                if name and not name.startswith("_"):
                    assert getattr(rp, name, None) is getattr(module, name), f"{file}: {name}"


def test_the_packages_state_is_one(rp):
    """Message set, compile cache, blocker mark: defined in one module each, the others share it."""
    for name, home in (("_SAID", "say"), ("_COMPILED", "softmax"), ("_BLOCKER_MARK", "blocker"),
                       ("_TE_ATTENTION_SERVED", "attention"), ("AFTER_IMPORT_TABLES", "hooks")):
        owners = [file for file in replacements.module_files()
                  if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
                         for node in ast.parse(replacements.source_text(file)).body)]
        assert owners == [f"{home}.py"], (name, owners)
    rp.say._SAID.discard("shared")
    rp.te_features.say_once("shared")
    assert "shared" in rp.say._SAID and rp.softmax.say_once is rp.say_once


# --- apex stand-ins the older eras' series point at ---------------------------------------------


def test_mix_prec_layer_norm_matches_torch_forward_and_backward(rp):
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    out, mean, invvar = rp.fused_mix_prec_layer_norm_cuda.forward_affine(x, (8,), w, b, 1e-5)
    assert mean.shape == invvar.shape == (12,)  # apex keeps one value per row, flat
    reference = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    assert torch.allclose(out, reference)
    g = torch.randn_like(x)
    grads = rp.fused_mix_prec_layer_norm_cuda.backward_affine(g, mean, invvar, x, (8,), w, b, 1e-5)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.layer_norm(xr, (8,), wr, br, 1e-5).backward(g)
    for got, want in zip(grads, (xr.grad, wr.grad, br.grad)):
        assert torch.allclose(got, want)


def test_fused_layer_norm_affine_is_layer_norm(rp):
    x, w, b = torch.randn(2, 5), torch.randn(5), torch.randn(5)
    assert torch.allclose(rp.fused_layer_norm_affine(x, w, b, (5,), 1e-6),
                          torch.nn.functional.layer_norm(x, (5,), w, b, 1e-6))


def test_amp_c_l2norm_and_scale_match_plain_torch(rp):
    tensors = [torch.randn(5), torch.randn(3, 3, dtype=torch.bfloat16)]
    flag = torch.zeros(1, dtype=torch.int)
    total, per_tensor = rp.multi_tensor_applier(rp.amp_C.multi_tensor_l2norm, flag, [tensors], True)
    everything = torch.cat([t.float().flatten() for t in tensors])
    assert torch.allclose(total, everything.norm().reshape(1))
    assert torch.allclose(per_tensor, torch.stack([t.float().norm() for t in tensors]))
    out = [torch.empty(5), torch.empty(3, 3, dtype=torch.bfloat16)]
    rp.multi_tensor_applier(rp.amp_C.multi_tensor_scale, flag, [tensors, out], 0.25)
    assert flag.item() == 0 and torch.equal(out[0], tensors[0] * 0.25)
    rp.multi_tensor_applier(rp.amp_C.multi_tensor_scale, flag, [[torch.tensor([float("inf")])], [torch.empty(1)]], 1.0)
    assert flag.item() == 1  # non-finite values raise the flag, as apex does


def test_fused_adam_is_adamw_and_takes_apex_arguments(rp):
    p1 = torch.nn.Parameter(torch.ones(3))
    p2 = torch.nn.Parameter(torch.ones(3))
    ours = rp.FusedAdam([p1], lr=0.1, weight_decay=0.01, bias_correction=True, set_grad_none=True)
    reference = torch.optim.AdamW([p2], lr=0.1, weight_decay=0.01)
    for opt, p in ((ours, p1), (reference, p2)):
        p.grad = torch.full((3,), 0.5)
        opt.step()
    assert torch.equal(p1, p2)
    with pytest.raises(ValueError, match="adam_w_mode"):
        rp.FusedAdam([torch.nn.Parameter(torch.ones(1))], adam_w_mode=False)
    assert isinstance(rp.FusedSGD([torch.nn.Parameter(torch.ones(1))], lr=0.1, wd_after_momentum=True), torch.optim.SGD)
    # apex's FusedAdam and FusedSGD decay no weights unless asked (torch's AdamW would, by 0.01)
    assert rp.FusedAdam([torch.nn.Parameter(torch.ones(1))]).defaults["weight_decay"] == 0.0
    assert rp.FusedSGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).defaults["weight_decay"] == 0.0


# ----------------------------------------------------------------------------------
# Upstream's defaults without TransformerEngine
# ----------------------------------------------------------------------------------


def test_rope_fusion_is_switched_off_with_one_line(rp, capsys):
    class Config:
        apply_rope_fusion = True

    rp.say._SAID.clear()
    config = Config()
    assert rp.switch_off_rope_fusion(config) is True and config.apply_rope_fusion is False
    rp.switch_off_rope_fusion(Config())
    out = capsys.readouterr().out
    assert out.count("> ROCm port: apply_rope_fusion") == 1, out


def _specs():
    def te_spec(num_experts=None, qk_layernorm=False, fp8=None, use_te_op_fuser=False):
        return ("te", num_experts, qk_layernorm)

    def local_spec(num_experts=None, qk_layernorm=False, normalization=None):
        return ("local", num_experts, qk_layernorm)

    return te_spec, local_spec


def test_te_spec_builds_the_local_spec_without_transformer_engine(rp, monkeypatch, capsys):
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: False)
    rp.say._SAID.clear()
    spec = rp.local_spec_without_transformer_engine(*_specs())
    assert spec(4, qk_layernorm=True) == ("local", 4, True)  # positional and named, by name
    assert spec(fp8="hybrid") == ("local", None, False)  # upstream's deprecated, unused argument
    assert "builds Megatron's local PyTorch layers" in capsys.readouterr().out
    with pytest.raises(ValueError, match="use_te_op_fuser need"):
        spec(use_te_op_fuser=True)
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: True)
    assert spec(4) == ("te", 4, False)


def _legacy_transformer_module(impl):
    """Upstream's legacy transformer module of main 2024-04-03 … 06-07, as far as the step reads it:
    ParallelTransformer reads the run's --transformer-impl and imports TE for TE's layers."""
    import types

    run_args = types.SimpleNamespace(transformer_impl=impl)

    class ParallelTransformer:
        def __init__(self, config):
            self.transformer_impl = run_args.transformer_impl
            if self.transformer_impl == "transformer_engine":
                import transformer_engine  # noqa: F401  (not installed here)

    return types.SimpleNamespace(ParallelTransformer=ParallelTransformer, get_args=lambda: run_args), run_args


def test_legacy_transformer_builds_local_layers_without_transformer_engine(rp, monkeypatch, capsys):
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: False)
    unported, _ = _legacy_transformer_module("transformer_engine")
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        unported.ParallelTransformer(None)
    module, run_args = _legacy_transformer_module("transformer_engine")
    for step in rp.after_import_steps("megatron.legacy.model.transformer"):
        step(module)
    rp.say._SAID.clear()
    assert module.ParallelTransformer(None).transformer_impl == "local" == run_args.transformer_impl
    module.ParallelTransformer(None)
    out = capsys.readouterr().out
    assert out.count("> ROCm port: TransformerEngine is not installed: the legacy model's") == 1, out
    # the older module name has it too; a run that asked for local layers hears nothing
    local, _ = _legacy_transformer_module("local")
    for step in rp.after_import_steps("megatron.model.transformer"):
        step(local)
    rp.say._SAID.clear()
    assert local.ParallelTransformer(None).transformer_impl == "local"
    assert "legacy model's" not in capsys.readouterr().out


def test_te_layers_stand_in_serves_only_unguarded_eras(rp, tmp_path):
    assert rp.TRANSFORMER_ENGINE_IMPORTS_GUARDED is True
    assert not any(isinstance(f, rp.te_absent._TransformerEngineLayersStandIn) for f in sys.meta_path)
    files = replacements.render(fully_masked_rows_are_zero=True, transformer_engine_imports_guarded=False)
    old = _load(files, tmp_path)
    try:
        finders = [f for f in sys.meta_path if isinstance(f, old.te_absent._TransformerEngineLayersStandIn)]
        assert len(finders) == 1
        spec = finders[0].find_spec(old.te_absent._TE_LAYERS_MODULE)
        assert (spec is not None) == (importlib.util.find_spec("transformer_engine") is None)
        assert finders[0].find_spec("megatron.core.transformer.attention") is None
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, old.te_absent._TransformerEngineLayersStandIn)]
        old.uninstall_import_blocker()


def test_te_layers_stand_in_names(rp):
    assert rp.te_absent._te_layers_attribute("SplitAlongDim") is None
    assert rp.te_absent._te_layers_attribute("get_cpu_offload_context") is None
    layer = rp.te_absent._te_layers_attribute("TEDotProductAttention")
    with pytest.raises(RuntimeError, match="TEDotProductAttention needs TransformerEngine"):
        layer()
    with pytest.raises(RuntimeError, match="te_helper needs TransformerEngine"):
        rp.te_absent._te_layers_attribute("te_helper")()
    with pytest.raises(AttributeError):
        rp.te_absent._te_layers_attribute("__path__")


# -- the compiled softmax (one kernel per pass where Triton is available) ---------------------
@pytest.fixture
def compiled(rp, monkeypatch):
    """rocm_port with compiling forced on (inductor writes C++ on a CPU), fresh caches."""
    monkeypatch.setenv(rp.softmax._COMPILE_ENV, "1")
    monkeypatch.setattr(rp.softmax, "_COMPILED", {})
    torch._dynamo.reset()  # compiled code is cached per function: no earlier test's counts
    monkeypatch.setattr(rp.say, "_SAID", set())
    return rp


def test_compiled_softmax_matches_the_references_forward_and_backward(compiled, monkeypatch, capsys):
    """The compiled bodies keep the kernels' semantics: the causal mask from indices, the
    unscaled -10000 for masked elements, zeroed fully masked rows, scale in the backward."""
    rp = compiled
    torch.manual_seed(11)
    mask = random_mask((2, 1, 6, 9))
    mask[1, 0, 4] = True  # a fully masked row
    cases = [
        (rp.ScaledUpperTriangMaskedSoftmax.apply, (0.125,), torch.bfloat16, dict(causal=True)),
        (rp.ScaledMaskedSoftmax.apply, (mask, 0.3), torch.float16, dict(mask=mask)),
        (rp.ScaledSoftmax.apply, (0.7,), torch.float32, {}),
    ]
    for fn, args, dtype, ref_kwargs in cases:
        x = torch.randn(2, 3, 6, 9 if "mask" in ref_kwargs else 6).to(dtype)
        y, g, gx = run_forward_backward(fn, x, *args)
        scale = args[-1]
        assert_close(y, ref_softmax(x, scale, **ref_kwargs), dtype, f"{fn} forward")
        assert_close(gx, ref_backward(g, y, scale), dtype, f"{fn} backward", backward_size(g, y, scale))
        if ref_kwargs.get("causal"):
            assert torch.equal(y.float().triu(1), torch.zeros_like(y.float()))
        if "mask" in ref_kwargs:
            assert torch.equal(y[1, :, 4], torch.zeros_like(y[1, :, 4]))
    assert {key[0] for key in rp.softmax._COMPILED} == {"forward", "backward"} and len(rp.softmax._COMPILED) == 6
    assert all(fn is not None for fn in rp.softmax._COMPILED.values())
    assert capsys.readouterr().out.count("> ROCm port: fused softmax: each pass compiled") == 1


def test_compiled_and_eager_paths_agree(compiled, monkeypatch):
    rp = compiled
    x = torch.randn(2, 4, 16, 16).bfloat16()
    torch.manual_seed(12)  # the same gradient for both
    fast = run_forward_backward(rp.ScaledUpperTriangMaskedSoftmax.apply, x, 0.125)
    monkeypatch.setenv(rp.softmax._COMPILE_ENV, "0")
    torch.manual_seed(12)
    eager = run_forward_backward(rp.ScaledUpperTriangMaskedSoftmax.apply, x, 0.125)
    assert torch.equal(fast[0], eager[0])
    assert_close(fast[2], eager[2].double(), torch.bfloat16, "backward", backward_size(eager[1], eager[0], 0.125))


def test_a_compile_failure_falls_back_to_the_eager_path_with_one_line(compiled, monkeypatch, capsys):
    rp = compiled

    def broken(*args, **kwargs):
        raise RuntimeError("no working Triton here\nsecond line")

    monkeypatch.setattr(torch, "compile", broken)
    torch.manual_seed(13)
    x = torch.randn(2, 3, 5, 5)
    y, g, gx = run_forward_backward(rp.ScaledUpperTriangMaskedSoftmax.apply, x, 0.5)
    run_forward_backward(rp.ScaledUpperTriangMaskedSoftmax.apply, x, 0.5)  # not tried again
    assert_close(y, ref_softmax(x, 0.5, causal=True), torch.float32, "forward")
    assert rp.softmax._COMPILED == {("forward", torch.float32, True, True, False): None, ("backward", torch.float32): None}
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "compiling failed" in ln]
    assert lines == ["> ROCm port: fused softmax: compiling failed (RuntimeError: no working Triton here); "
                     "the eager PyTorch path runs instead"]


def test_compiling_is_chosen_for_gpus_with_triton_only(rp, monkeypatch):
    monkeypatch.delenv(rp.softmax._COMPILE_ENV, raising=False)
    monkeypatch.setattr(rp.softmax, "_triton_available", lambda: True)
    assert rp.softmax._compile_wanted(torch.device("cuda", 0)) and not rp.softmax._compile_wanted(torch.device("cpu"))
    monkeypatch.setattr(rp.softmax, "_triton_available", lambda: False)
    assert not rp.softmax._compile_wanted(torch.device("cuda", 0))
    monkeypatch.setenv(rp.softmax._COMPILE_ENV, "0")
    monkeypatch.setattr(rp.softmax, "_triton_available", lambda: True)
    assert not rp.softmax._compile_wanted(torch.device("cuda", 0))


def test_compiled_softmax_stores_nothing_input_sized_but_its_result(compiled):
    """The memory goal of the compiled path, read off the code inductor generates: besides the
    result, each pass allocates only per-row statistics (max, sum), never a full-size temporary
    or a causal mask. (Inductor decides what to materialise before it writes C++ or Triton.)"""
    import re

    from torch._inductor.utils import run_and_get_code

    rp = compiled
    passes = {}
    for sk in (48, 1024):
        x = torch.randn(1, 4, 64, sk).bfloat16()
        y = torch.softmax(x.float(), -1).bfloat16()
        passes.update({
            f"causal forward, sk {sk}": (rp.softmax._softmax_forward_body, (x, None, 0.125, float("-inf"), True, False)),
            f"masked forward, sk {sk}": (rp.softmax._softmax_forward_body,
                                         (x, random_mask((1, 1, 64, sk)), 0.3, rp.MASKED_VALUE, False, True)),
            f"backward, sk {sk}": (rp.softmax._softmax_backward_body, (torch.randn_like(x), y, 0.3)),
        })
    for what, (body, args) in passes.items():
        x = args[0]
        _, code = run_and_get_code(torch.compile(body, dynamic=False, fullgraph=True), *args)
        sizes = []
        for shape in re.findall(r"= empty_strided_\w+\(\(([\d, ]*)\)", "\n".join(code)):
            numel = 1
            for d in (int(v) for v in shape.split(",") if v.strip()):
                numel *= d
            sizes.append(numel)
        full = [n for n in sizes if n >= x.numel()]
        assert len(full) == 1, f"{what}: buffers of {sizes} elements; only the result may be input-sized"
        assert all(n <= x.numel() // x.shape[-1] for n in sizes if n < x.numel()), (what, sizes)


def test_no_compile_starts_inside_a_cuda_graph_capture(compiled, monkeypatch):
    """Compiling while a CUDA graph is captured would fail: such a call runs eager, and the
    compiled path is taken by the first call outside a capture."""
    rp = compiled
    monkeypatch.setattr(rp.softmax, "_capturing", lambda device: True)
    x = torch.randn(2, 3, 4, 4)
    y, g, gx = run_forward_backward(rp.ScaledSoftmax.apply, x, 0.5)
    assert rp.softmax._COMPILED == {}
    assert_close(y, ref_softmax(x, 0.5), torch.float32, "forward")
    monkeypatch.setattr(rp.softmax, "_capturing", lambda device: False)
    run_forward_backward(rp.ScaledSoftmax.apply, x, 0.5)
    assert len(rp.softmax._COMPILED) == 2 and all(fn is not None for fn in rp.softmax._COMPILED.values())


def _tiny_megatron(root: Path, files: dict) -> None:
    """A throwaway ``megatron`` package under ``root`` with the given modules' sources."""
    for name, text in {"megatron/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            init = root / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
        path.write_text(text)


@pytest.fixture
def tiny_megatron(tmp_path, monkeypatch):
    """Import a throwaway ``megatron`` (with the port's after-import finder active), then forget it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda files: _tiny_megatron(tmp_path, files)
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]


def test_inpainting_of_2022_imports_and_calls_resize(rp, tiny_megatron):
    """Upstream 2022-02..2023-09: inpainting.py imports resize_, utils.py defines resize, forward calls resize."""
    tiny_megatron({
        "megatron/model/vision/utils.py": "def resize(x, size=None):\n    return ('resized', x, size)\n",
        "megatron/model/vision/inpainting.py": "from megatron.model.vision.utils import resize_\n\n"
                                                "def forward(x):\n    return resize(x, size=2)\n",
    })
    inpainting = importlib.import_module("megatron.model.vision.inpainting")
    assert inpainting.forward(1) == ("resized", 1, 2)





def test_t5s_sentinel_tokens_survive_todays_transformers(rp, tiny_megatron):
    """core 0.14 … 2026-05: the wrapper reads its sentinels back through a name transformers 5 dropped."""
    tiny_megatron({"megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py": HF_WRAPPER_2025})
    wrapper = importlib.import_module("megatron.core.tokenizers.text.libraries.huggingface_tokenizer")
    tokenizer = wrapper.MegatronHFTokenizer("bert-large-cased", additional_special_tokens=["<extra_id_0>", "<extra_id_1>"])
    assert tokenizer.additional_special_tokens_ids == [2, 3]
    assert wrapper.HuggingFaceTokenizer("bert-large-cased").additional_special_tokens_ids == []


def test_core_05_to_08s_save_planner_learns_it_is_the_coordinator_on_todays_torch(rp, tiny_megatron):
    """core 0.5 … 0.8 pass is_coordinator second, where torch 2.4 put storage_meta: every rank then
    wrote its sharded objects twice and saving died of 'item.index.fqn not in md'."""
    tiny_megatron({"megatron/core/dist_checkpointing/strategies/torch.py": (
        "from torch.distributed.checkpoint.default_planner import DefaultSavePlanner\n\n\n"
        "class MCoreSavePlanner(DefaultSavePlanner):\n    pass\n")})
    module = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    planner = module.MCoreSavePlanner()
    planner.set_up_planner({}, True)  # what core 0.6's state_dict_saver calls
    assert planner.is_coordinator is True
    planner.set_up_planner({}, is_coordinator=False)  # core 0.9 on
    assert planner.is_coordinator is False


def test_core_05_to_012s_async_writer_calls_todays_write_item(rp, tiny_megatron, tmp_path):
    """core 0.5 … 0.12 call torch's private _write_item without the transforms and serialization
    format today's torch takes; every writer process died of a TypeError."""
    tiny_megatron({"megatron/core/dist_checkpointing/strategies/filesystem_async.py": (
        "from torch.distributed.checkpoint.filesystem import _write_item\n\n\n"
        "def write(stream, data, write_item, storage_key):\n"
        "    return _write_item(stream, data, write_item, storage_key)\n")})
    module = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
    import io
    stream = io.BytesIO()
    result = module.write(stream, io.BytesIO(b"abc"), WriteItem(MetadataIndex("x"), WriteItemType.BYTE_IO), "k")
    assert result.storage_data.relative_path == "k" and stream.getvalue() == b"abc"


def test_megatrons_own_checkpoints_load_whole_on_todays_torch(rp, tiny_megatron, tmp_path):
    """torch 2.6's weights_only default refused the Namespace Megatron pickles in its checkpoints."""
    import argparse

    tiny_megatron({"megatron/core/dist_checkpointing/serialization.py": (
        "import torch\n\n\ndef load_common(path):\n    return torch.load(path, map_location='cpu')\n")})
    module = importlib.import_module("megatron.core.dist_checkpointing.serialization")
    path = tmp_path / "common.pt"
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2)}, path)
    assert module.load_common(path)["args"].tensor_model_parallel_size == 2
    assert module.torch.Tensor is torch.Tensor and torch.load.__name__ == "load"


def test_local_multi_tensor_fallbacks_become_the_ports_amp_c(rp, tiny_megatron, monkeypatch):
    """Without TE and apex, clip_grads' local fallbacks (bf16 norms in bf16) give way to the port's."""
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: False)
    tiny_megatron({
        "megatron/core/utils.py": "def local_multi_tensor_applier(op, flag, lists, *args):\n    return 'local'\n"
                                  "local_multi_tensor_l2_norm = local_multi_tensor_scale = local_multi_tensor_applier\n",
        "megatron/core/optimizer/clip_grads.py": "from megatron.core.utils import local_multi_tensor_applier as "
                                                 "multi_tensor_applier, local_multi_tensor_l2_norm as l2_norm_impl, "
                                                 "local_multi_tensor_scale as multi_tensor_scale_impl\n",
    })
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    # (by name: every rocm_port module these tests load installs its own finder)
    for name, port in (("multi_tensor_applier", rp.multi_tensor_applier), ("l2_norm_impl", rp.amp_C.multi_tensor_l2norm),
                       ("multi_tensor_scale_impl", rp.amp_C.multi_tensor_scale)):
        assert getattr(clip, name).__qualname__ == port.__qualname__, name
    grads = [torch.full((3,), 2.0, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16)]
    norm, _ = clip.multi_tensor_applier(clip.l2_norm_impl, torch.zeros(1, dtype=torch.int), [grads], False)
    assert norm.dtype == torch.float32 and abs(norm.item() - 17 ** 0.5) < 1e-6


def test_rope_fusion_is_switched_off_before_upstreams_checks(rp, tiny_megatron, monkeypatch, capsys):
    """core 0.8 on: TransformerConfig raises when apply_rope_fusion (on by default) finds no fused kernel."""
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: False)
    rp.say._SAID.clear()
    tiny_megatron({"megatron/core/transformer/transformer_config.py": (
        "from dataclasses import dataclass\n\n\n@dataclass\nclass TransformerConfig:\n"
        "    apply_rope_fusion: bool = True\n\n    def __post_init__(self):\n"
        "        if self.apply_rope_fusion:\n            raise ValueError('apply_rope_fusion is not available')\n")})
    config = importlib.import_module("megatron.core.transformer.transformer_config").TransformerConfig()
    assert config.apply_rope_fusion is False
    assert "RoPE runs unfused" in capsys.readouterr().out


#: upstream 104f7dcd3d … 6b35ca80e8 (2024-08-05 … 09-18), BertModel's mask check in its shape (and spelling)
BERT_MODEL_TE_VERSION_WINDOW = """from importlib.metadata import version

bert_layer_with_transformer_engine_spec = bert_layer_local_spec = object()


def get_te_version():
    return version("transformer-engine")


class BertModel:
    def __init__(self, transformer_layer_spec):
        self.attn_mask_dimensions = self._santiy_check_attention_and_get_attn_mask_dimension(transformer_layer_spec)

    def _santiy_check_attention_and_get_attn_mask_dimension(self, transformer_layer_spec):
        attn_mask_dimensions = "b1ss"
        if transformer_layer_spec == bert_layer_with_transformer_engine_spec:
            if get_te_version() >= "1.7.0":
                attn_mask_dimensions = "b11s"
        return attn_mask_dimensions
"""


def test_bert_built_from_the_te_spec_without_te_takes_the_local_layers_mask(rp, tiny_megatron, monkeypatch):
    """Without TE the TE spec builds local layers; the window's BertModel asked TE's version for it."""
    import importlib.metadata

    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: False)
    files = {"megatron/core/models/bert/bert_model.py": BERT_MODEL_TE_VERSION_WINDOW}
    tiny_megatron(files)
    bert = importlib.import_module("megatron.core.models.bert.bert_model")
    assert bert.BertModel(bert.bert_layer_with_transformer_engine_spec).attn_mask_dimensions == "b1ss"
    unported = {}
    exec(compile(BERT_MODEL_TE_VERSION_WINDOW, "bert_model.py", "exec"), unported)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        unported["BertModel"](unported["bert_layer_with_transformer_engine_spec"])


def test_a_module_takes_every_after_import_step_of_both_tables_in_order(rp, tmp_path, monkeypatch):
    """One module may need a step whatever is installed and more without TransformerEngine (the
    local DotProductAttention: SDPA routing, and MLA's channels): all of them run, in order."""
    package = tmp_path / "after_import_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layer.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ran = []
    monkeypatch.setitem(rp.hooks._AFTER_IMPORT_DEEPSPEED, "after_import_pkg.layer", lambda m: ran.append(("always", m.VALUE)))
    monkeypatch.setitem(rp.hooks._AFTER_IMPORT_WITHOUT_TE, "after_import_pkg.layer",
                        (lambda m: ran.append(("no TE 1", m.VALUE)), lambda m: ran.append(("no TE 2", m.VALUE))))
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: False)
    for name in ("after_import_pkg.layer", "after_import_pkg"):
        sys.modules.pop(name, None)
    importlib.import_module("after_import_pkg.layer")
    assert ran == [("always", 1), ("no TE 1", 1), ("no TE 2", 1)]
    monkeypatch.setattr(rp.te_absent, "_transformer_engine_installed", lambda: True)
    assert rp.after_import_steps("after_import_pkg.layer") == (rp.hooks._AFTER_IMPORT_DEEPSPEED["after_import_pkg.layer"],)
    sys.modules.pop("after_import_pkg.layer", None)


def test_todays_deepspeed_fp16_optimizers_answer_cur_scale_again(rp):
    """Megatron-DeepSpeed before 3ed9f4f7 (2023-05) formats ``optimizer.cur_scale`` into its log
    line; today's DeepSpeed fp16 optimizers without ZeRO keep the scale in loss_scale_config."""
    import types

    class LossScaleConfig:
        cur_scale = 4096.0

    class FP16_Optimizer:
        def __init__(self):
            self.loss_scale_config = LossScaleConfig()

    class FP16_UnfusedOptimizer(FP16_Optimizer):
        pass

    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        rp.fp16_optimizers_answer_cur_scale(types.SimpleNamespace(LossScaleConfig=LossScaleConfig, **{cls.__name__: cls}))
        optimizer = cls()
        assert optimizer.cur_scale == 4096.0
        optimizer.cur_scale = 1024.0
        assert optimizer.loss_scale_config.cur_scale == 1024.0
    assert {"deepspeed.runtime.fp16.fused_optimizer", "deepspeed.runtime.fp16.unfused_optimizer"} <= \
        set(dict(rp.AFTER_IMPORT_TABLES)["DeepSpeed"])

    class Old:  # an older DeepSpeed keeps cur_scale itself: left alone
        pass

    rp.fp16_optimizers_answer_cur_scale(types.SimpleNamespace(FP16_Optimizer=Old))
    assert "cur_scale" not in vars(Old)


def test_todays_torch_gets_back_typed_storage_untyped_for_2023s_distributed_optimizer(rp):
    """Upstream main 2022-09-30 … 2023-12-01 (and Stanford's fork) builds the distributed optimizer's
    parameter buffers as ``torch.tensor(grad_buffer.data.storage()._untyped(), dtype=params_dtype)``:
    torch 2.0 renamed the method and every ``--use-distributed-optimizer`` run died building the
    optimizer (Stanford 85f95aef, dp2-distopt). The port restores it: the grad buffer's own bytes."""
    rp.install_target_stack_compat()
    grad = torch.zeros(8)
    view = torch.tensor(grad.storage()._untyped(), dtype=torch.float16, device=grad.device)
    assert view.numel() == 16 and view.data_ptr() == grad.data_ptr()
    view.fill_(1.0)
    assert grad.abs().sum() > 0  # one buffer, seen in two dtypes
