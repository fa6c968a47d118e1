"""CPU proxies for what the replacements cost on a GPU, where this machine has none.

On a CPU the softmax works in 16 MiB blocks and GEMMs dominate a training step, so wall time
here says little about a GPU. These tests run the code paths a GPU takes (the GPU's workspace
blocking, the mixed-dtype GEMM, the foreach kernels) on CPU tensors and measure what a GPU
would pay for them, not how long they take:

- peak extra memory of the softmax, forward and backward, from a dispatch mode that tallies the
  bytes of every live tensor storage after each aten op (goal: at most 2.5x the input);
- host syncs (``aten._local_scalar_dense``, what ``.item()``/``bool()`` run) of the ``amp_C``
  stand-ins, which must not grow with the number of gradients (goal: none at all);
- the dtypes of the GEMM operands in the weight-gradient stand-in: no fp32 copy of an fp16/bf16
  operand on the GPU path (aten's ``addmm.dtype_out``) or on the fallback.

Each fast path is also checked against its reference path for values and gradients, and each
fallback is checked to be taken when the fast API is missing.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from support.port import load  # noqa: E402

aten = torch.ops.aten


@pytest.fixture(scope="module")
def rp():
    module = load(prefix="_rocm_port_gpu_paths")
    yield module
    module.uninstall_import_blocker()


@pytest.fixture
def gpu_blocking(rp, monkeypatch):
    """The workspace blocking a GPU uses, on CPU tensors."""
    monkeypatch.setattr(rp.softmax, "_block_elements", lambda device, numel: rp.softmax._gpu_block_elements(numel))


class LiveBytes(TorchDispatchMode):
    """Tallies the bytes of tensor storages created inside the mode that are still alive.

    Checked after every aten op: the peak is what the code held at once on top of what existed
    before (the caller's input and gradient), as a GPU caching allocator would count it.
    """

    def __init__(self):
        super().__init__()
        self.live = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view of (or an op writing into) a tensor from before the mode is not new memory.
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and key not in given and storage.nbytes():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class OpLog(TorchDispatchMode):
    """Records (op, output dtypes, output shapes); can stand in for ops this backend lacks."""

    def __init__(self, emulate=None):
        super().__init__()
        self.calls = []
        self.emulate = emulate or {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.emulate[func](*args, **kwargs) if func in self.emulate else func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        self.calls.append((func, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors]))
        return out

    def ops(self):
        return [f for f, _, _ in self.calls]


# ---------------------------------------------------------------------------------------------
# Softmax: memory of the GPU path, and the fast path against the reference path
# ---------------------------------------------------------------------------------------------

SOFTMAX_CASES = ["causal", "masked", "plain"]


def _softmax_call(rp, which, x, scale):
    if which == "causal":
        return rp.ScaledUpperTriangMaskedSoftmax.apply(x, scale)
    if which == "masked":
        gen = torch.Generator().manual_seed(1)
        mask = torch.rand((x.shape[0], 1) + tuple(x.shape[-2:]), generator=gen) < 0.3
        return rp.ScaledMaskedSoftmax.apply(x, mask, scale)
    return rp.ScaledSoftmax.apply(x, scale)


def peak_extra_multiple(rp, which, dtype, scale):
    """Peak extra bytes of forward + backward, as a multiple of the input's bytes."""
    shape = (4, 8, 128, 128) if which != "causal" else (32, 128, 128)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(shape, generator=gen).to(dtype)
    tally = LiveBytes()
    with tally:
        y = _softmax_call(rp, which, x, scale)
        y.backward(g)
        del y
    return tally.peak / (x.numel() * x.element_size())


@pytest.mark.parametrize("which", SOFTMAX_CASES)
@pytest.mark.parametrize("scale", [1.0, 0.125, 0.3], ids=lambda s: f"scale{s}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_softmax_gpu_path_extra_memory_is_at_most_2_5x_the_input(rp, gpu_blocking, which, scale, dtype):
    multiple = peak_extra_multiple(rp, which, dtype, scale)
    assert multiple <= 2.5, f"{which} softmax fwd+bwd held {multiple:.2f}x the input on top of it"


def test_memory_tally_sees_a_full_size_fp32_copy(rp):
    """The tally is not blind: an fp32 copy of a bf16 input shows as 2x the input."""
    x = torch.randn(64, 64).bfloat16()
    tally = LiveBytes()
    with tally:
        y = x.float()
    assert tally.peak / (x.numel() * x.element_size()) == pytest.approx(2.0)
    del y


@pytest.mark.parametrize("which", SOFTMAX_CASES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.125])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_softmax_input_dtype_path_matches_the_fp32_path(rp, monkeypatch, which, scale, dtype):
    """Power-of-two scales run in the input dtype; the fp32 workspace path is the reference."""
    assert rp.softmax._exact_in_input_dtype(dtype, scale)
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(2, 4, 16, 16, generator=gen)).to(dtype)
    g = torch.randn(2, 4, 16, 16, generator=gen).to(dtype)

    def run():
        xr = x.clone().requires_grad_(True)
        y = _softmax_call(rp, which, xr if which != "causal" else xr.view(8, 16, 16), scale)
        y.backward(g if which != "causal" else g.view(8, 16, 16))
        return y.detach().reshape(x.shape), xr.grad

    fast_y, fast_dx = run()
    monkeypatch.setattr(rp.softmax, "_exact_in_input_dtype", lambda dtype, scale: False)
    ref_y, ref_dx = run()
    assert torch.equal(fast_y, ref_y), "forward differs from the fp32 path"
    # The backward is one rounding of the same fp32 result, but summed in another order.
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    err = (fast_dx.double() - ref_dx.double()).abs().max().item()
    assert err <= 2 * ulp * ref_dx.double().abs().max().item(), f"backward differs by {err}"


def test_bf16_padding_mask_keeps_the_literal_mask_value(rp):
    """bf16 cannot hold -10000.0 (it rounds to -9984.0): masked softmax then works in fp32, so
    unmasked logits at -9984.0 still outweigh the masked elements, as in the kernel."""
    assert not rp.softmax._holds_exactly(torch.bfloat16, rp.MASKED_VALUE)
    assert rp.softmax._holds_exactly(torch.float16, rp.MASKED_VALUE)
    x = torch.full((1, 1, 2, 4), -19968.0, dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 2, 4, dtype=torch.bool)
    mask[..., 0] = True
    y = rp.ScaledMaskedSoftmax.apply(x, mask, 0.5).double()
    z = torch.tensor([-10000.0, -9984.0, -9984.0, -9984.0], dtype=torch.float64)
    want = torch.softmax(z, -1)
    assert torch.allclose(y[0, 0, 0], want, rtol=1e-2, atol=0), y


@pytest.mark.parametrize("scale,exact", [(1.0, True), (0.5, True), (0.125, True), (0.3, False),
                                         (2.0, False), (0.0884, False), (-0.5, False)])
def test_only_exact_scales_stay_in_the_input_dtype(rp, scale, exact):
    assert rp.softmax._exact_in_input_dtype(torch.bfloat16, scale) is exact
    assert rp.softmax._exact_in_input_dtype(torch.float32, scale) is True


# ---------------------------------------------------------------------------------------------
# amp_C stand-ins: host syncs per step, values
# ---------------------------------------------------------------------------------------------


def _syncs_of_one_step(rp, n_tensors):
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, generator=gen) for _ in range(n_tensors)]
    grads += [torch.randn(5, generator=gen).bfloat16() for _ in range(n_tensors)]
    model = [torch.empty(7).bfloat16() for _ in range(n_tensors)]
    flag = torch.zeros(1, dtype=torch.int)
    log = OpLog()
    with log:
        rp.multi_tensor_applier(rp.amp_C.multi_tensor_l2norm, flag, [grads], True)
        rp.multi_tensor_applier(rp.amp_C.multi_tensor_scale, flag, [grads, grads], 0.5)
        rp.multi_tensor_applier(rp.amp_C.multi_tensor_scale, flag, [grads[:n_tensors], model], 1.0)
        rp.multi_tensor_applier(rp.amp_C.multi_tensor_scale, flag, [grads[:n_tensors], model], 0.25)
    return sum(1 for f in log.ops() if f in (aten._local_scalar_dense.default, aten.is_nonzero.default))


def test_amp_c_stand_ins_never_sync_the_host(rp):
    assert _syncs_of_one_step(rp, 3) == 0
    assert _syncs_of_one_step(rp, 48) == 0


def test_sync_count_sees_an_item_call(rp):
    """The counter is not blind: one .item() is one sync."""
    log = OpLog()
    with log:
        torch.ones(2).sum().item()
    assert log.ops().count(aten._local_scalar_dense.default) == 1


def test_l2norm_accumulates_low_precision_gradients_in_fp32(rp):
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(1000, generator=gen).bfloat16(), torch.randn(3, 5, generator=gen)]
    flag = torch.zeros(1, dtype=torch.int)
    total, each = rp.amp_C.multi_tensor_l2norm(0, flag, [grads], True)
    want_each = torch.stack([t.double().norm() for t in grads])
    assert total.dtype == torch.float32 and each.dtype == torch.float32
    assert torch.allclose(each.double(), want_each, rtol=1e-6)
    assert abs(total.item() - want_each.norm().item()) <= 1e-6 * want_each.norm().item()
    assert flag.item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_values_raise_the_flag(rp, bad):
    flag = torch.zeros(1, dtype=torch.int)
    rp.amp_C.multi_tensor_l2norm(0, flag, [[torch.tensor([1.0, bad])]], False)
    assert flag.item() == 1
    for dst in (torch.empty(2), torch.empty(2).bfloat16()):
        flag.zero_()
        rp.amp_C.multi_tensor_scale(0, flag, [[torch.tensor([1.0, bad])], [dst]], 0.5)
        assert flag.item() == 1, dst.dtype


def test_scale_into_lower_precision_rounds_once_from_fp32(rp):
    gen = torch.Generator().manual_seed(5)
    src = [torch.randn(257, generator=gen)]
    dst = [torch.empty(257).bfloat16()]
    flag = torch.zeros(1, dtype=torch.int)
    rp.amp_C.multi_tensor_scale(0, flag, [src, dst], 0.3)
    assert torch.equal(dst[0], (src[0] * 0.3).bfloat16())


# ---------------------------------------------------------------------------------------------
# Weight-gradient accumulation: operand dtypes on the GPU path and on the fallback
# ---------------------------------------------------------------------------------------------


def _addmm_dtype_out_by_reference(acc, mat1, mat2, out_dtype, *, beta=1, alpha=1, out):
    """What aten::addmm.dtype_out computes, for a backend (this CPU) that lacks it."""
    assert out_dtype == out.dtype
    out.copy_((beta * acc.double() + alpha * (mat1.double() @ mat2.double())).to(out_dtype))
    return out


def _fp32_operand_copies(log, operand_numels):
    return [(f, shapes) for f, dtypes, shapes in log.calls
            if f not in (aten.addmm.dtype_out,)
            and any(d == torch.float32 and int(torch.Size(s).numel()) in operand_numels
                    for d, s in zip(dtypes, shapes))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wgrad_gpu_path_uses_the_mixed_dtype_gemm_without_fp32_copies(rp, monkeypatch, dtype):
    monkeypatch.setattr(rp.apex_substitutes, "_addmm_out_dtype_ok", lambda device: True)
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-4, 5, (3, 10, 24), generator=gen).to(dtype)
    g = torch.randint(-4, 5, (3, 10, 16), generator=gen).to(dtype)
    main_grad = torch.randint(-4, 5, (16, 24), generator=gen).float()
    want = main_grad.double() + g.reshape(30, 16).double().t() @ x.reshape(30, 24).double()
    log = OpLog(emulate={aten.addmm.dtype_out: _addmm_dtype_out_by_reference})
    with log:
        rp.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert aten.addmm.dtype_out in log.ops()
    assert not _fp32_operand_copies(log, {x.numel(), g.numel()})
    assert torch.equal(main_grad.double(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wgrad_fallback_without_the_mixed_dtype_gemm(rp, dtype):
    """This CPU lacks aten::addmm.dtype: the product is formed in the operands' dtype and added."""
    assert rp.apex_substitutes._addmm_out_dtype_ok(torch.device("cpu")) is False
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-4, 5, (2, 8, 12), generator=gen).to(dtype)
    g = torch.randint(-4, 5, (2, 8, 6), generator=gen).to(dtype)
    main_grad = torch.randint(-4, 5, (6, 12), generator=gen).float()
    want = main_grad.double() + g.reshape(16, 6).double().t() @ x.reshape(16, 12).double()
    log = OpLog()
    with log:
        rp.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert aten.addmm.dtype_out not in log.ops()
    assert not _fp32_operand_copies(log, {x.numel(), g.numel()})
    assert torch.equal(main_grad.double(), want)  # small integers: exact in any dtype


# ---------------------------------------------------------------------------------------------
# FusedAdam: torch's fused step where the device has it, the same numbers as the loop
# ---------------------------------------------------------------------------------------------


def _adam_run(rp, **kwargs):
    torch.manual_seed(8)
    params = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(3))]
    opt = rp.FusedAdam(params, lr=1e-2, weight_decay=0.1, bias_correction=True, adam_w_mode=True, **kwargs)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (step + 1)) * (i + 1)
        opt.step()
    return opt, [p.detach().clone() for p in params]


def test_fused_adam_takes_the_fused_step_and_matches_the_loop(rp, monkeypatch):
    fused_opt, fused = _adam_run(rp)
    assert fused_opt.defaults["fused"] is True
    monkeypatch.setattr(rp.apex_substitutes, "_fused_supported", lambda params: False)
    loop_opt, loop = _adam_run(rp)
    assert not loop_opt.defaults.get("fused")
    for a, b in zip(fused, loop):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adam_respects_an_explicit_choice(rp):
    opt, _ = _adam_run(rp, foreach=False)
    assert not opt.defaults.get("fused")
