"""Attention smoke: the port's core attention through scaled_dot_product_attention.

The tree's rocm_port.sdpa_core_attention against the fp64 reference of Megatron's unfused core
attention (reference.py: two GEMMs around the kernels' softmax), forward and backward, for every
mask kind, dtype and head layout it serves (causal, padding with fully masked rows as the era has
them, GQA, MLA's value head dim), on the verify device; and the port's blockwise kernel (attention
dropout where SDPA's flash kernel takes none) the same way, and its dropout's backward by
gradcheck; and the tree's own core attention class (DotProductAttention, the legacy CoreAttention)
routed through it by the port's after-import step, with the scale it derives from the class's own
settings.
"""

from __future__ import annotations

import math

import pytest

from megaport.smoke import _era, _locate, _verdicts
from megaport.smoke import reference as ref

torch = pytest.importorskip("torch")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# relative to the reference's magnitude; two GEMMs and a softmax in the input dtype
TOLERANCE = {"fp32": 2e-5, "fp16": 3e-3, "bf16": 2e-2}
LAYOUTS = {"mha": (4, 4, 32, 32), "gqa": (4, 2, 32, 32), "mla": (4, 4, 48, 32)}  # heads, groups, dk, dv
KINDS = ("causal", "padding", "none")


def inputs(layout, dtype, device, sq=40, b=2, seed=3):
    heads, groups, dk, dv = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(sq, b, n, dk, generator=gen).to(dtype).to(device) for n in (heads, groups))
    v = torch.randn(sq, b, groups, dv, generator=gen).to(dtype).to(device)
    mask = torch.rand(b, 1, sq, sq, generator=gen) < 0.3
    mask[0, 0, 5] = True  # a fully masked query row (BERT's padded positions)
    grad = torch.randn(sq, b, heads * dv, generator=gen).to(dtype).to(device)
    return q, k, v, mask.to(device), grad


def check(actual, expected, dtype_id, what):
    error = ref.max_error(actual, expected)
    bound = TOLERANCE[dtype_id] * max(1.0, expected.abs().max().item())
    assert error <= bound, f"{what}: max error {error:.3g} > {bound:.3g}"


def forward_backward(attention, q, k, v, grad):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves)
    out.backward(grad.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def expected(q, k, v, grad, scale, causal, mask, zero):
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    out = ref.core_attention(*leaves, scale, causal=causal, mask=None if mask is None else mask.cpu(),
                             fully_masked_rows_are_zero=zero)
    out.backward(grad.double().cpu())
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("kernel", ("sdpa", "blockwise"))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_sdpa_core_attention_matches_fp64_reference(smoke, rocm_port, device, monkeypatch, kind, dtype_id, layout,
                                                    kernel):
    """The port's core attention, every mask kind, head layout and dtype: SDPA's call, and the
    port's blockwise kernel (causal attention dropout where SDPA's flash kernel takes none: the
    CPU) forced in its place with blocks of 16 rows, dropout 0 so the reference applies."""
    sdpa = _verdicts.port_name(rocm_port, "sdpa_core_attention")
    if kernel == "blockwise":
        attention = _locate.home_of(_verdicts.port_name(rocm_port, "blockwise_attention"))
        monkeypatch.setattr(attention, "blockwise_wanted", lambda *args: True)
        monkeypatch.setattr(attention, "_BLOCK_ELEMENTS", 16)
    q, k, v, mask, grad = inputs(layout, DTYPES[dtype_id], device)
    scale = 1 / math.sqrt(q.shape[-1])
    given = mask if kind == "padding" else None
    out, grads = forward_backward(
        lambda *t: sdpa(*t, scale=scale, causal=kind == "causal", mask=given,
                        fully_masked_rows_are_zero=smoke.fully_masked_rows_are_zero),
        q, k, v, grad)
    want, want_grads = expected(q, k, v, grad, scale, kind == "causal", given, smoke.fully_masked_rows_are_zero)
    assert out.is_contiguous(), "the context is not contiguous, as upstream's is: the era's linear layers view it in 2-D"
    check(out, want, dtype_id, "forward")
    for name, got, reference in zip(("dq", "dk", "dv"), grads, want_grads):
        check(got, reference, dtype_id, name)


@pytest.mark.parametrize("kind", ("causal", "padding"))
def test_blockwise_dropout_backward_is_the_forwards_derivative(rocm_port, device, monkeypatch, kind):
    """With dropout, backward draws each block's mask again from forward's seed: gradcheck in fp64
    on the verify device, GQA, three blocks."""
    blockwise = _verdicts.port_name(rocm_port, "blockwise_attention")
    monkeypatch.setattr(_locate.home_of(blockwise), "_BLOCK_ELEMENTS", 16)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
    k, v = (torch.randn(1, 1, 40, 8, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
            for _ in range(2))
    mask = (torch.rand(1, 1, 40, 40, generator=gen) > 0.3).to(device) if kind == "padding" else None

    def attention(q, k, v):
        torch.manual_seed(11)  # the same masks at each evaluation (the device's generator too)
        return blockwise(q, k, v, attn_mask=mask, dropout_p=0.3, is_causal=kind == "causal", scale=0.5,
                         enable_gqa=True)

    assert torch.autograd.gradcheck(attention, (q, k, v))
    without = blockwise(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=kind == "causal", scale=0.5,
                        enable_gqa=True)
    assert not torch.equal(attention(q, k, v), without), "dropout 0.3 changed nothing"


class _Enum:
    def __init__(self, name):
        self.name = name


def _routed_instance(cls, fused_softmax, dtype, *, mask_type, layer_scaling, softmax_scale):
    """An instance of the tree's own core attention class with the attributes its forward reads,
    built without Megatron's parallel state: its softmax is the tree's FusedScaleMaskSoftmax."""
    core = cls.__new__(cls)
    torch.nn.Module.__init__(core)
    coeff = 3.0 if layer_scaling else None
    values = {"input_in_fp16": dtype == torch.float16, "input_in_bf16": dtype == torch.bfloat16,
              "attn_mask_type": _Enum(mask_type), "scaled_masked_softmax_fusion": True,
              "mask_func": lambda s, m: s.masked_fill_(m, -10000.0), "softmax_in_fp32": True, "scale": coeff}
    import inspect

    accepted = inspect.signature(fused_softmax.FusedScaleMaskSoftmax.__init__).parameters
    core.scale_mask_softmax = fused_softmax.FusedScaleMaskSoftmax(**{k: v for k, v in values.items() if k in accepted})
    core.attn_mask_type = _Enum(mask_type)
    core.attention_dropout = torch.nn.Dropout(0.0)
    if softmax_scale:  # DotProductAttention: the GEMM's alpha, already divided by the coefficient
        core.softmax_scale = 1.0 / (math.sqrt(32) * (coeff or 1.0))
    else:  # the legacy CoreAttention: alpha = 1 / norm_factor
        core.norm_factor = math.sqrt(32) * (coeff or 1.0)
    core.config = None
    return core


def _check_routed(smoke, cls, fused_softmax, device, *, softmax_scale):
    assert getattr(cls, "_rocm_port_sdpa", False), (
        f"{cls.__module__}.{cls.__name__} was not routed through SDPA: the port's after-import step did not run")
    for kind, dtype_id in (("causal", "bf16"), ("padding", "fp16")):
        dtype = DTYPES[dtype_id]
        q, k, v, mask, grad = inputs("mha", dtype, device)
        core = _routed_instance(cls, fused_softmax, dtype, mask_type=kind, layer_scaling=True,
                                softmax_scale=softmax_scale)
        out, grads = forward_backward(lambda *t: core(*t, mask if kind == "padding" else None), q, k, v, grad)
        want, want_grads = expected(q, k, v, grad, 1 / math.sqrt(32), kind == "causal",
                                    mask if kind == "padding" else None, smoke.fully_masked_rows_are_zero)
        check(out, want, dtype_id, f"{cls.__name__} {kind} forward")
        for name, got, reference in zip(("dq", "dk", "dv"), grads, want_grads):
            check(got, reference, dtype_id, f"{cls.__name__} {kind} {name}")


@pytest.mark.in_upstream("class DotProductAttention", "megatron/core/transformer/dot_product_attention.py")
def test_dot_product_attention_runs_through_sdpa(smoke, rocm_port, fused_softmax, device):
    module = _era.era_module(smoke, "megatron.core.transformer.dot_product_attention")
    _check_routed(smoke, module.DotProductAttention, fused_softmax, device, softmax_scale=True)


@pytest.mark.in_upstream("class CoreAttention", "megatron/legacy/model/transformer.py", "megatron/model/transformer.py")
def test_legacy_core_attention_runs_through_sdpa(smoke, rocm_port, fused_softmax, device):
    module = _era.era_module(smoke, "megatron.legacy.model.transformer", "megatron.model.transformer")
    _check_routed(smoke, module.CoreAttention, fused_softmax, device, softmax_scale=False)
