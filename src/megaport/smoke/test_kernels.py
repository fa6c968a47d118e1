"""Kernel smoke: the tree's fused softmax against fp64 references with the era's semantics.

The three autograd functions and FusedScaleMaskSoftmax come from the tree's own fused_softmax
module; the references (reference.py) are written from the CUDA kernels' semantics. Whether
fully masked rows are zeros or uniform comes from the series' catalogue entry (``fully_masked_rows``),
never from the tree's own constant. Runs on the verify device in fp32, fp16 and bf16.
"""

from __future__ import annotations

import inspect

import pytest

from megaport.smoke import _locate
from megaport.smoke import reference as ref

torch = pytest.importorskip("torch")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SCALE = 0.125

# name → (input shape [b, np, sq, sk]); causal cases need sq == sk.
SHAPES = {
    "small-odd": (2, 3, 13, 13),  # nothing divisible by 4
    "sk-4099": (1, 2, 3, 4099),  # beyond the kernels' sk <= 4096, odd
}
CAUSAL_SHAPES = {
    "small-odd": (2, 3, 13, 13),
    "sq-sk-4099": (1, 1, 4099, 4099),  # causal beyond 4096 (the fused path's limit)
}
KINDS = ("causal", "masked", "plain")


def _cases():
    for kind in KINDS:
        shapes = CAUSAL_SHAPES if kind == "causal" else SHAPES
        for shape_id, shape in shapes.items():
            for dtype_id in DTYPES:
                marks = ()
                if shape_id == "sq-sk-4099" and dtype_id != "bf16":
                    # 16.8M elements: seconds on a CPU; bf16 (training's dtype) covers it there.
                    marks = pytest.mark.gpu_only("16.8M-element causal case; on CPU the bf16 case covers this shape")
                yield pytest.param(kind, dtype_id, shape, id=f"{kind}-{dtype_id}-{shape_id}", marks=marks)


def make_mask(shape, device, *, seed=0, fully_masked_row=True):
    b, _, sq, sk = shape
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand((b, 1, sq, sk), generator=gen) < 0.3
    if fully_masked_row and sq > 1:
        mask[0, 0, 1, :] = True
    return mask.to(device)


def run(fs, kind, x, mask, scale):
    """Forward through the tree's function the way FusedScaleMaskSoftmax calls it."""
    if kind == "causal":
        b, np_, sq, sk = x.shape
        return fs.ScaledUpperTriangMaskedSoftmax.apply(x.view(-1, sq, sk), scale).view(b, np_, sq, sk)
    if kind == "masked":
        return fs.ScaledMaskedSoftmax.apply(x, mask, scale)
    return fs.ScaledSoftmax.apply(x, scale)


def expected(smoke, kind, x, mask, scale):
    return ref.softmax(x, scale, mask=mask if kind == "masked" else None, causal=kind == "causal",
                       fully_masked_rows_are_zero=smoke.fully_masked_rows_are_zero)


def inputs(shape, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)
    g = torch.randn(shape, generator=gen).to(dtype).to(device)
    return x, g


def forward_backward(fs, kind, shape, dtype, device):
    x, g = inputs(shape, dtype, device)
    mask = make_mask(shape, device) if kind == "masked" else None
    xr = x.clone().requires_grad_(True)
    y = run(fs, kind, xr, mask, SCALE)
    y.backward(g)
    # Large cases: every row is computed, a spread of rows is compared (the fp64 reference of
    # 16.8M elements would cost more than the code under test).
    rows = _sample_rows(shape[-2]) if x.numel() > (1 << 22) else None
    pick = (lambda t: t) if rows is None else (lambda t: t.index_select(-2, rows.to(t.device)))
    return x, g, mask, y.detach(), xr.grad, rows, pick


@pytest.mark.parametrize("kind,dtype_id,shape", list(_cases()))
def test_softmax_forward_matches_fp64_reference(fused_softmax, smoke, device, kind, dtype_id, shape):
    dtype = DTYPES[dtype_id]
    x, g, mask, y, grad, rows, pick = forward_backward(fused_softmax, kind, shape, dtype, device)
    assert y.dtype == dtype, f"output dtype {y.dtype}, input {dtype}: the kernels return the input dtype"
    assert y.shape == x.shape
    want = ref.softmax(pick(x), SCALE, mask=None if mask is None else pick(mask), causal=kind == "causal",
                       fully_masked_rows_are_zero=smoke.fully_masked_rows_are_zero, rows=rows)
    err = ref.max_error(pick(y), want)
    assert err <= ref.tolerance(dtype), f"{kind} forward ({dtype_id}, {tuple(shape)}): max error {err:.3g}"


@pytest.mark.parametrize("kind,dtype_id,shape", list(_cases()))
def test_softmax_backward_matches_fp64_reference(fused_softmax, smoke, device, kind, dtype_id, shape):
    """dx = scale * (y*g - y*sum(y*g)) from the saved output, in fp32 math, in the input dtype."""
    dtype = DTYPES[dtype_id]
    x, g, mask, y, grad, rows, pick = forward_backward(fused_softmax, kind, shape, dtype, device)
    assert grad.dtype == dtype
    got_y = pick(y)
    want_grad = ref.softmax_backward(pick(g), got_y, SCALE)
    size = ref.backward_size(pick(g), got_y, SCALE)
    gerr = ref.max_error(pick(grad), want_grad)
    assert gerr <= ref.tolerance(dtype) * max(size, 1e-30), (
        f"{kind} backward ({dtype_id}, {tuple(shape)}): max error {gerr:.3g} vs size {size:.3g}"
        + _scale_hint(pick(grad), want_grad))


def _sample_rows(sq: int):
    picks = set(range(0, 8)) | set(range(sq // 2 - 4, sq // 2 + 4)) | set(range(sq - 8, sq))
    picks |= set(range(0, sq, max(1, sq // 64)))
    return torch.tensor(sorted(p for p in picks if 0 <= p < sq))


def _scale_hint(got, want) -> str:
    """Name the usual bug: the backward returns the unscaled gradient."""
    w = want.double().flatten()
    gflat = got.double().flatten().to(w.device)
    denom = (w * w).sum().item()
    if denom == 0:
        return ""
    ratio = (gflat * w).sum().item() / denom
    if abs(ratio * SCALE - 1) < 0.05:
        return f"; the gradient is 1/scale = {1 / SCALE:g} times too large: backward is missing the scale"
    return f"; least-squares ratio to the reference {ratio:.4g}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_softmax_backward_applies_scale(fused_softmax, smoke, device, kind, scale):
    """dx = scale * (y*g - y*sum(y*g)): the kernels multiply the gradient by the forward's scale."""
    shape = (1, 2, 8, 8)
    x, g = inputs(shape, torch.float32, device, seed=7)
    mask = make_mask(shape, device, fully_masked_row=False) if kind == "masked" else None
    xr = x.clone().requires_grad_(True)
    y = run(fused_softmax, kind, xr, mask, scale)
    y.backward(g)
    want = ref.softmax_backward(g, y.detach(), scale)
    w = want.flatten()
    ratio = (xr.grad.double().flatten().to(w.device) * w).sum().item() / (w * w).sum().item()
    assert abs(ratio - 1) < 1e-4, (
        f"{kind} backward with scale {scale}: gradient is {ratio:.4g} x the reference"
        + (" (backward is missing the scale)" if abs(ratio * scale - 1) < 1e-3 else ""))


# Unmasked inputs that, times 0.5, land just above -10000 in each dtype (exactly representable).
NEAR_MASK_VALUE = {"fp32": -19998.0, "fp16": -19984.0, "bf16": -19968.0}


@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_masked_elements_are_minus_10000_not_inf(fused_softmax, smoke, device, dtype_id):
    """Masked elements become a literal -10000.0: not -inf, and not scaled.

    The unmasked logits are scaled to just above -10000, so the masked elements keep a visible
    share of each row (e^-d each); -inf masking gives them exactly 0, a scaled mask value almost all.
    """
    dtype = DTYPES[dtype_id]
    scale = 0.5
    value = NEAR_MASK_VALUE[dtype_id]
    x = torch.full((1, 1, 4, 8), value, dtype=dtype)
    assert x[0, 0, 0, 0].item() == value
    mask = torch.zeros((1, 1, 4, 8), dtype=torch.bool)
    mask[..., :3] = True  # three masked elements per row
    y = fused_softmax.ScaledMaskedSoftmax.apply(x.to(device), mask.to(device), scale).double().cpu()
    want = ref.softmax(x, scale, mask=mask, fully_masked_rows_are_zero=smoke.fully_masked_rows_are_zero)
    got, expect = y[..., :3], want[..., :3]
    assert expect.min().item() > 0
    rel = ((got - expect).abs() / expect).max().item()
    assert rel < 0.1, (
        f"masked elements get probability {got[0, 0, 0, 0].item():.3g}, the kernels' -10000.0 gives "
        f"{expect[0, 0, 0, 0].item():.3g} (unmasked logits scaled to {value * scale:g}): "
        + ("masking uses -inf instead of the literal -10000.0" if got.max().item() == 0
           else "the mask value is scaled or is not -10000.0"))


@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_fully_masked_rows_follow_the_era(fused_softmax, smoke, device, dtype_id):
    dtype = DTYPES[dtype_id]
    shape = (2, 2, 4, 24)
    x, _ = inputs(shape, dtype, device, seed=3)
    mask = torch.zeros((2, 1, 4, 24), dtype=torch.bool)
    mask[0, 0, 2, :] = True
    mask[1, 0, 0, :] = True
    mask = mask.to(device)
    y = fused_softmax.ScaledMaskedSoftmax.apply(x, mask, SCALE).double().cpu()
    rows = torch.cat([y[0, :, 2], y[1, :, 0]])
    want = "zeros" if smoke.fully_masked_rows_are_zero else "uniform 1/sk"
    target = torch.zeros_like(rows) if smoke.fully_masked_rows_are_zero else torch.full_like(rows, 1 / 24)
    assert not torch.isnan(rows).any(), "fully masked rows came out NaN (-inf masking?)"
    assert torch.allclose(rows, target, atol=ref.tolerance(dtype)), (
        f"fully masked rows must be {want} in this era (series {smoke.series}, catalogue "
        f"fully_masked_rows={'zero' if smoke.fully_masked_rows_are_zero else 'uniform'}); got {rows[0, :4].tolist()}")


@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_causal_future_is_exactly_zero(fused_softmax, device, dtype_id):
    dtype = DTYPES[dtype_id]
    x, _ = inputs((1, 3, 17, 17), dtype, device, seed=5)
    y = run(fused_softmax, "causal", x, None, SCALE)
    future = ref.causal_future(17, 17, y.device)
    assert (y[..., future] == 0).all(), "causal softmax must give exact zeros above the diagonal"


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_fp64(fused_softmax, smoke, device, kind):
    """The backward is the derivative of the forward (fp64, torch.autograd.gradcheck)."""
    shape = (1, 2, 5, 7) if kind != "causal" else (1, 2, 6, 6)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
    # A fully masked row is constant in x; its backward only matches the derivative where the
    # era zeroes it (older kernels return a uniform row yet still apply the formula).
    mask = make_mask(shape, device, fully_masked_row=smoke.fully_masked_rows_are_zero) if kind == "masked" else None

    def fn(t):
        return run(fused_softmax, kind, t, mask, 0.7)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# FusedScaleMaskSoftmax: the module attention actually calls
# ---------------------------------------------------------------------------------------------


def attn_mask_type(fs, kind):
    enum = getattr(fs, "AttnMaskType", None)
    if enum is None:
        pytest.fail("FusedScaleMaskSoftmax takes attn_mask_type, but the tree's fused_softmax module has no "
                    "AttnMaskType", pytrace=False)
    return enum.causal if kind == "causal" else enum.padding


def mask_func(scores, mask):
    """Upstream's attention_mask_func: masked_fill_(mask, -10000.0). Only the torch path uses it."""
    scores.masked_fill_(mask, -10000.0)
    return scores


def make_fused_module(fs, kind, dtype, scale):
    """The tree's FusedScaleMaskSoftmax with the fusion on, built the way its era takes it: an
    attn_mask_type (2021-02 on) or v2.0's upper_triang_mask_fusion/general_mask_fusion flags."""
    cls = fs.FusedScaleMaskSoftmax
    params = inspect.signature(cls.__init__).parameters
    values = {
        "input_in_fp16": lambda: dtype == torch.float16,
        "input_in_bf16": lambda: dtype == torch.bfloat16,
        "attn_mask_type": lambda: attn_mask_type(fs, kind),
        "upper_triang_mask_fusion": lambda: kind == "causal",
        "general_mask_fusion": lambda: kind != "causal",
        "scaled_masked_softmax_fusion": lambda: True,
        "mask_func": lambda: mask_func,
        "softmax_in_fp32": lambda: True,
        "scale": lambda: scale,
    }
    missing = [p for p in params if p not in values and p != "self" and params[p].default is inspect._empty]
    if missing:
        # Every era's signature is known to the suite: an unknown one is a change to the module
        # the port's softmax runs in, never a reason to leave it untested.
        pytest.fail(f"FusedScaleMaskSoftmax takes {missing}, which no upstream era has", pytrace=False)
    return cls(**{k: make() for k, make in values.items() if k in params})


class _Recorded:
    """Stands in for one of the tree's softmax autograd functions in its fused_softmax module and
    records each call: FusedScaleMaskSoftmax looks them up there when it takes the fused path."""

    def __init__(self, function, calls: list):
        self.function, self.calls = function, calls

    def apply(self, *args):
        self.calls.append(self.function.__name__)
        return self.function.apply(*args)


# bf16 training arrived in 2021-02 (input_in_bf16); before, fp16 is the one fused dtype.
_BF16_IN_ERA = pytest.mark.in_upstream("input_in_bf16",
                                       *(n.replace(".", "/") + ".py" for n in _locate.FUSED_SOFTMAX_MODULES))


@pytest.mark.parametrize("kind", ["causal", "padding"])
@pytest.mark.parametrize("dtype_id", ["fp16", pytest.param("bf16", marks=_BF16_IN_ERA)])
def test_fused_scale_mask_softmax_takes_the_fused_path(fused_softmax, smoke, device, monkeypatch, kind, dtype_id):
    """Training shapes (fp16/bf16, sk <= 2048, multiples of 4) go through the replacement: the
    module calls the tree's softmax function, whatever way its era decides (is_kernel_available
    from 2021-03; inline conditions before, which also want the causal mask passed)."""
    dtype = DTYPES[dtype_id]
    shape = (2, 4, 32, 32)
    module = make_fused_module(fused_softmax, kind, dtype, SCALE)
    x, g = inputs(shape, dtype, device, seed=9)
    b, np_, sq, sk = shape
    if kind == "padding":
        mask = make_mask(shape, device)
    else:
        mask = ref.causal_future(sq, sk, device).expand(b, 1, sq, sk)
    if hasattr(module, "is_kernel_available"):
        assert module.is_kernel_available(mask, b, np_, sq, sk), (
            "FusedScaleMaskSoftmax refuses the fused path for a training shape (get_batch_per_block?)")
    calls = []
    for name in ("ScaledUpperTriangMaskedSoftmax", "ScaledMaskedSoftmax", "ScaledSoftmax"):
        if hasattr(fused_softmax, name):
            monkeypatch.setattr(fused_softmax, name, _Recorded(getattr(fused_softmax, name), calls))
    xr = x.clone().requires_grad_(True)
    y = module(xr, mask)
    monkeypatch.undo()
    assert calls, "FusedScaleMaskSoftmax took upstream's torch path for a training shape, not the port's softmax"
    direct = run(fused_softmax, "causal" if kind == "causal" else "masked", x, mask, SCALE)
    assert torch.equal(y.detach(), direct), "the module's fused path differs from the tree's softmax function"
    want = expected(smoke, "causal" if kind == "causal" else "masked", x, mask, SCALE)
    err = ref.max_error(y.detach(), want)
    assert err <= ref.tolerance(dtype), f"FusedScaleMaskSoftmax {kind} {dtype_id}: forward error {err:.3g}"
    y.backward(g)
    want_grad = ref.softmax_backward(g, y.detach(), SCALE)
    size = ref.backward_size(g, y.detach(), SCALE)
    assert ref.max_error(xr.grad, want_grad) <= ref.tolerance(dtype) * size


@pytest.mark.parametrize("dtype_id", ["fp16", "bf16"])
def test_fused_scale_mask_softmax_long_padding_mask(fused_softmax, smoke, device, dtype_id):
    """sk > 4096 leaves the fused path in every era: the module's own torch path must still agree.

    Rows with at least one unmasked element only: upstream's torch path gives fully masked rows
    uniform, whatever the era's kernel did.
    """
    dtype = DTYPES[dtype_id]
    shape = (1, 2, 4, 4104)
    module = make_fused_module(fused_softmax, "padding", dtype, SCALE)
    x, _ = inputs(shape, dtype, device, seed=13)
    mask = make_mask(shape, device, fully_masked_row=False)
    y = module(x, mask)
    want = ref.softmax(x, SCALE, mask=mask)
    assert y.dtype == dtype
    assert ref.max_error(y, want) <= ref.tolerance(dtype)
