"""Core attention through scaled_dot_product_attention (rocm_port's SDPA path).

Checked against an fp64 reference of Megatron's unfused core attention written here (two GEMMs
around the masked softmax with the kernels' semantics: masked elements -10000.0, causal future
exact zeros, fully masked rows zero or uniform by era), forward and backward, for every mask
kind, dtype and head layout the port routes through SDPA; and the routing itself on a core
attention shaped like upstream's (what runs, what falls back, what the log says).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from support.port import load  # noqa: E402

# relative to the reference's largest magnitude; bf16 rounds the inputs and the output once each
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LAYOUTS = {  # (heads, groups, qk head dim, v head dim)
    "mha": (4, 4, 16, 16),
    "gqa": (4, 2, 16, 16),
    "mqa": (4, 1, 16, 16),
    "mla-v-narrower": (4, 4, 24, 16),
    "mla-v-wider": (4, 4, 16, 24),
}


@pytest.fixture(scope="module")
def rp():
    module = load(prefix="_rocm_port_sdpa")
    yield module
    module.uninstall_import_blocker()


def reference(q, k, v, scale, causal, mask, fully_masked_rows_are_zero):
    """Megatron's unfused core attention in fp64: [s, b, n, d] in, [sq, b, n*dv] out."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    heads, groups = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    sq, sk = scores.shape[-2:]
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
    elif mask is not None:
        probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)
        if fully_masked_rows_are_zero:
            probs = probs.masked_fill(mask.all(-1, keepdim=True), 0.0)
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs @ v
    return out.permute(2, 0, 1, 3).reshape(sq, q.shape[0], -1)


def inputs(layout, dtype, sq=24, sk=24, b=2, seed=0):
    heads, groups, dk, dv = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, dk, generator=g).to(dtype).requires_grad_()
    k = torch.randn(sk, b, groups, dk, generator=g).to(dtype).requires_grad_()
    v = torch.randn(sk, b, groups, dv, generator=g).to(dtype).requires_grad_()
    return q, k, v


def padding_mask(b, sq, sk, dead_rows=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, 1, sq, sk, generator=g) < 0.3
    if dead_rows:
        mask[0, 0, 3] = True  # a fully masked query row, as BERT's padded positions give
        mask[1, 0, -1] = True
    return mask


def close(actual, expected, dtype, what):
    err = (actual.double() - expected).abs().max().item()
    bound = TOL[dtype] * max(1.0, expected.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


#: the port's two kernels behind sdpa_core_attention: SDPA's own call, and the blockwise kernel
#: (causal attention dropout on a CPU) forced, with blocks of 16 query rows over 40 rows (three
#: blocks, so every block and causal-diagonal boundary is crossed), dropout 0 so the reference applies
KERNELS = {"sdpa": 24, "blockwise": 40}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["causal", "padding", "padding-uniform-rows", "none"])
def test_sdpa_matches_fp64_reference_forward_and_backward(rp, request, monkeypatch, kind, layout, dtype, kernel):
    if kernel == "blockwise":
        monkeypatch.setattr(rp.attention, "blockwise_wanted", lambda *args: True)
        request.getfixturevalue("small_blocks")
    rows = KERNELS[kernel]
    q, k, v = inputs(layout, dtype, sq=rows, sk=rows)
    mask = padding_mask(2, rows, rows) if kind.startswith("padding") else None
    zero = kind != "padding-uniform-rows"
    scale = 1 / math.sqrt(q.shape[-1]) * 0.9
    out = rp.sdpa_core_attention(q, k, v, scale=scale, causal=kind == "causal", mask=mask,
                                 fully_masked_rows_are_zero=zero)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, scale, kind == "causal", mask, zero)
    assert out.dtype == dtype and out.shape == ref.shape
    assert out.is_contiguous(), "the context is not contiguous: the era's linear layers view it in 2-D in backward"
    close(out, ref, dtype, "forward")
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad.to(dtype))
    ref.backward(grad.double())
    for name, got, want in (("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        close(got, want, dtype, name)


def test_fully_masked_rows_follow_the_era(rp):
    q, k, v = inputs("gqa", torch.float32)
    mask = padding_mask(2, 24, 24)
    zero = rp.sdpa_core_attention(q, k, v, scale=0.25, causal=False, mask=mask, fully_masked_rows_are_zero=True)
    uniform = rp.sdpa_core_attention(q, k, v, scale=0.25, causal=False, mask=mask, fully_masked_rows_are_zero=False)
    assert torch.count_nonzero(zero[3, 0]) == 0
    v_mean = v[:, 0].mean(0).repeat_interleave(2, dim=0).reshape(-1)  # each head's group's mean value
    torch.testing.assert_close(uniform[3, 0], v_mean)
    assert torch.isfinite(zero).all() and torch.isfinite(uniform).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gradients_leave_sdpa_contiguous_as_the_unfused_gemms_left_them(rp, dtype):
    """2021-2022's linear layers ``view`` their output's gradient in backward: T5's cross-attention
    key and value, split from one linear's output, must get contiguous gradients back."""
    sk, b, n, d = 24, 2, 4, 8
    kv_linear = torch.randn(sk, b, n * 2 * d, dtype=dtype, requires_grad=True)
    key, value = kv_linear.view(sk, b, n, 2 * d).split(d, dim=-1)
    query = torch.randn(12, b, n, d, dtype=dtype, requires_grad=True)
    seen = []
    for t in (query, key, value):
        t.register_hook(lambda grad: seen.append(grad.is_contiguous()))
    out = rp.sdpa_core_attention(query, key, value, scale=0.25, causal=False, mask=padding_mask(b, 12, sk))
    out.float().square().sum().backward()
    assert seen == [True, True, True]
    kv_linear.grad.view(sk * b, n * 2 * d)  # what upstream's backward does with it


def test_causal_ignores_the_mask_as_the_kernel_does(rp):
    q, k, v = inputs("mha", torch.bfloat16)
    everything_masked = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    a = rp.sdpa_core_attention(q, k, v, scale=0.25, causal=True, mask=everything_masked)
    b = rp.sdpa_core_attention(q, k, v, scale=0.25, causal=True)
    assert torch.equal(a, b)


def test_sdpa_agrees_with_the_ports_kernel_exact_softmax_path(rp):
    """The two paths the port has: SDPA and the kernel replacement plus two GEMMs."""
    q, k, v = inputs("mha", torch.float16, sq=32, sk=32)
    mask = padding_mask(2, 32, 32)
    scale = 0.125
    scores = torch.matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 3, 0)).float() * 1.0
    probs = rp.ScaledMaskedSoftmax.apply(scores.half(), mask, scale)
    kernel_path = (probs @ v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3).reshape(32, 2, -1)
    sdpa = rp.sdpa_core_attention(q, k, v, scale=scale, causal=False, mask=mask,
                                  fully_masked_rows_are_zero=rp.FULLY_MASKED_ROWS_ARE_ZERO)
    torch.testing.assert_close(sdpa.float(), kernel_path.float(), atol=4e-3, rtol=4e-3)


def test_backend_is_named(rp):
    q, k, v = (t.permute(1, 2, 0, 3) for t in inputs("mha", torch.bfloat16))
    name = rp.sdpa_backend(q, k, v, None, 0.0, True, 0.25, False)
    assert name in ("flash", "efficient", "math", "cudnn", "unknown")
    if not torch.cuda.is_available():
        assert name == "flash", "torch's CPU flash kernel should take bf16 causal attention"


# --- routing, on a core attention shaped like upstream's DotProductAttention -----------------

class _Softmax:
    def __init__(self, fusion=True, fp16=False, bf16=True, scale=None, window_size=None):
        self.scaled_masked_softmax_fusion = fusion
        self.input_in_float16 = fp16 or bf16
        self.scale = scale
        self.window_size = window_size


class _Enum:
    def __init__(self, name):
        self.name = name


def _core_class():
    class DotProductAttention(torch.nn.Module):
        calls = 0

        def __init__(self, softmax, mask_type="causal", dropout=0.0, config=None):
            super().__init__()
            self.scale_mask_softmax = softmax
            self.attn_mask_type = _Enum(mask_type)
            self.attention_dropout = torch.nn.Dropout(dropout)
            self.softmax_scale = 0.25 / (softmax.scale or 1.0)
            self.config = config

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            type(self).calls += 1
            return torch.zeros(query.shape[0], query.shape[1], query.shape[2] * value.shape[3], dtype=query.dtype)

    return DotProductAttention


@pytest.fixture
def routed(rp, monkeypatch, capsys):
    rp.say._SAID.clear()
    rp.attention._SDPA_SAID.clear()
    cls = _core_class()
    rp.attention._route_core_attention_through_sdpa(cls, ("query", "key", "value", "attention_mask"))
    return cls


def test_routing_runs_sdpa_with_the_cores_scale_and_says_so(rp, routed, capsys):
    core = routed(_Softmax(scale=3.0))  # layer scaling: alpha 0.25/3 times the softmax's 3
    q, k, v = inputs("gqa", torch.bfloat16)
    out = core(q, k, v, None)
    assert routed.calls == 0, "upstream's forward ran: SDPA did not"
    ref = reference(q.detach(), k.detach(), v.detach(), 0.25, True, None, True)
    close(out, ref, torch.bfloat16, "routed forward")
    log = capsys.readouterr().out
    assert "> ROCm port: core attention: torch scaled_dot_product_attention (" in log
    assert "causal mask" in log


@pytest.mark.parametrize("why, make", [
    ("MEGATRON_ROCM_PORT_SDPA=0", lambda cls, mp: (mp.setenv("MEGATRON_ROCM_PORT_SDPA", "0"), cls(_Softmax()))[1]),
    ("--attention-backend unfused",
     lambda cls, mp: cls(_Softmax(), config=type("C", (), {"attention_backend": _Enum("unfused")})())),
    ("--no-masked-softmax-fusion", lambda cls, mp: cls(_Softmax(fusion=False))),
    ("sliding attention window", lambda cls, mp: cls(_Softmax(window_size=(8, 0)))),
])
def test_routing_keeps_the_softmax_path_and_says_why(rp, routed, monkeypatch, capsys, why, make):
    core = make(routed, monkeypatch)
    q, k, v = inputs("mha", torch.bfloat16)
    core(q, k, v, None)
    assert routed.calls == 1, "SDPA ran where the softmax path was asked for"
    assert why in capsys.readouterr().out


def test_routing_keeps_the_softmax_path_for_an_attention_bias(rp, routed, capsys):
    core = routed(_Softmax())
    q, k, v = inputs("mha", torch.bfloat16)
    core(q, k, v, None, attention_bias=torch.zeros(1))
    assert routed.calls == 1
    assert "attention bias" in capsys.readouterr().out


def test_routing_padding_mask_in_fp32_keeps_uniform_rows(rp, routed):
    """fp32 never took the kernel: upstream's torch softmax gives a fully masked row uniformly."""
    core = routed(_Softmax(bf16=False), mask_type="padding")
    q, k, v = inputs("mha", torch.float32)
    mask = padding_mask(2, 24, 24)
    out = core(q, k, v, mask)
    close(out, reference(q.detach(), k.detach(), v.detach(), 0.25, False, mask, False), torch.float32, "fp32 padding")


def test_dropout_runs_under_the_cores_rng_tracker(rp, routed, monkeypatch):
    forks = []

    class Tracker:
        def fork(self):
            import contextlib
            forks.append(1)
            return contextlib.nullcontext()

    import sys
    module = sys.modules[routed.__module__]
    monkeypatch.setattr(module, "tensor_parallel", type("TP", (), {"get_cuda_rng_tracker": staticmethod(Tracker)}),
                        raising=False)
    core = routed(_Softmax(), dropout=0.5)
    q, k, v = inputs("mha", torch.float32)
    core.train()
    out = core(q, k, v, None)
    assert forks == [1] and routed.calls == 0
    core.eval()
    assert torch.equal(core(q, k, v, None), core(q, k, v, None))
    assert not torch.equal(out, core(q, k, v, None)), "dropout 0.5 in training changed nothing"


@pytest.mark.parametrize("lengths, causal", [((24, 24), True), ((24, 24), False), ((10, 17, 5), True)])
def test_flash_attn_varlen_stand_in_matches_per_sequence_attention(rp, lengths, causal):
    """--use-flash-attn without flash_attn: packed sequences [total, h, d], per-sequence attention."""
    g = torch.Generator().manual_seed(5)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 4, 16, generator=g, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = rp.flash_attn_varlen_sdpa(q, k, v, cu, cu, max(lengths), max(lengths), 0.0, softmax_scale=0.3, causal=causal)
    for start, n in zip(cu[:-1].tolist(), lengths):
        qs, ks, vs = (t[start:start + n].detach().double().permute(1, 0, 2) for t in (q, k, v))
        scores = qs @ ks.transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        want = (torch.softmax(scores, -1) @ vs).permute(1, 0, 2)
        torch.testing.assert_close(out[start:start + n].double(), want, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flash_attn_varlen_stand_in_takes_dropout_blockwise_on_the_cpu(rp, monkeypatch):
    """--use-flash-attn's dropout on the CPU: the blockwise kernel, not SDPA's math kernel."""
    calls = []
    blockwise = rp.blockwise_attention
    monkeypatch.setattr(rp.attention, "blockwise_attention", lambda *a, **k: calls.append(k["dropout_p"]) or blockwise(*a, **k))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(48, 4, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 24, 48], dtype=torch.int32)
    torch.manual_seed(3)
    dropped = rp.flash_attn_varlen_sdpa(q, k, v, cu, cu, 24, 24, 0.5, softmax_scale=0.25, causal=True)
    assert calls == [0.5]
    kept = rp.flash_attn_varlen_sdpa(q, k, v, cu, cu, 24, 24, 0.0, softmax_scale=0.25, causal=True)
    assert calls == [0.5] and not torch.equal(dropped, kept)


def test_causal_flash_attn_with_fewer_queries_is_bottom_right_aligned(rp):
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    cq, ck = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = rp.flash_attn_varlen_sdpa(q, k, v, cq, ck, 3, 5, 0.0, softmax_scale=1.0, causal=True)
    # query i of 3 sees keys 0 .. i + 2 of 5: the last every key, the first keys 0..2
    for i in range(3):
        seen = i + 3
        weights = torch.softmax(torch.einsum("hd,khd->hk", q[i], k[:seen]), -1)
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", weights, v[:seen]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
def test_attention_dropout_on_the_cpu_runs_blockwise_and_says_so(rp, routed, capsys, dtype):
    """SDPA's CPU flash kernel takes no dropout: the port's blockwise attention does, in every dtype."""
    core = routed(_Softmax(fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16), dropout=0.5)
    q, k, v = inputs("gqa", dtype)
    core.train()
    trained = core(q, k, v, None)
    assert routed.calls == 0, "attention dropout on the CPU fell back to upstream's forward"
    said = capsys.readouterr().out
    assert "blockwise attention on cpu" in said and "attention dropout 0.5" in said and "causal future skipped" in said
    core.eval()
    evaluated = core(q, k, v, None)
    assert torch.equal(evaluated, core(q, k, v, None)) and routed.calls == 0
    assert "scaled_dot_product_attention" in capsys.readouterr().out, "evaluation (no dropout) should run SDPA"
    assert not torch.equal(trained, evaluated), "dropout 0.5 in training changed nothing"


def test_padding_attention_dropout_on_the_cpu_keeps_the_softmax_path_and_says_why(rp, routed, capsys):
    """No causal future to skip: the blockwise kernel would be slower than the softmax path."""
    core = routed(_Softmax(), mask_type="padding", dropout=0.1)
    q, k, v = inputs("mha", torch.bfloat16)
    core.train()
    core(q, k, v, padding_mask(2, 24, 24))
    assert routed.calls == 1, "padding-mask dropout on the CPU did not keep the softmax path"
    assert "attention dropout with a padding mask on cpu" in capsys.readouterr().out


# --- blockwise attention: attention dropout where SDPA's flash kernel takes none ------------------

@pytest.fixture
def small_blocks(rp, monkeypatch):
    """Blocks of 16 query rows, so every test crosses block and causal-diagonal boundaries."""
    monkeypatch.setattr(rp.attention, "_BLOCK_ELEMENTS", 16)


@pytest.mark.parametrize("causal, groups", [(True, 2), (False, 2), (True, 1)])
def test_blockwise_dropout_backward_is_the_forwards_derivative(rp, small_blocks, causal, groups):
    """Backward draws each block's dropout mask again from the seed forward drew: gradcheck in fp64
    over three blocks, with a padding mask where not causal."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, groups, 40, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = None if causal else torch.rand(1, 1, 40, 40, generator=g) > 0.3

    def attention(q, k, v):
        torch.manual_seed(11)  # the same masks at each of gradcheck's evaluations
        return rp.blockwise_attention(q, k, v, attn_mask=mask, dropout_p=0.3, is_causal=causal, scale=0.5,
                                      enable_gqa=groups != 2)

    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_blockwise_dropout_draws_from_the_current_generator_and_keeps_the_expectation(rp, small_blocks):
    """Megatron's RNG tracker forks the generator around attention: the masks follow its state;
    dropout keeps 1 - p of the weights, scaled by 1 / (1 - p)."""
    ones, eye = torch.ones(1, 1, 64, 8, dtype=torch.float64), torch.eye(64, dtype=torch.float64)[None, None]

    def run(seed):
        torch.manual_seed(seed)
        return rp.blockwise_attention(ones, ones, eye, dropout_p=0.25)

    first, again, other = run(1), run(1), run(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    kept = (first > 0).double().mean().item()
    assert abs(kept - 0.75) < 0.03, f"kept {kept:.3f} of the weights at dropout 0.25"
    assert abs(first.sum(-1).mean().item() - 1.0) < 0.03, "dropout changed the expected row sum"


def test_te_attention_asked_for_runs_sdpa_even_with_the_softmax_fusion_off(rp, routed, monkeypatch, capsys):
    """Upstream's Mixtral script passes --no-masked-softmax-fusion beside TE's layers: what it asks
    for is TE's fused attention, which the port serves through SDPA where it built the local spec."""
    monkeypatch.setattr(rp.attention, "_TE_ATTENTION_SERVED", True)
    core = routed(_Softmax(fusion=False))
    q, k, v = inputs("gqa", torch.bfloat16)
    core(q, k, v, None)
    assert routed.calls == 0, "the local spec served for TE's ran upstream's unfused attention"
    monkeypatch.setattr(rp.attention, "_TE_ATTENTION_SERVED", False)
    core(q, k, v, None)
    assert routed.calls == 1 and "--no-masked-softmax-fusion" in capsys.readouterr().out
