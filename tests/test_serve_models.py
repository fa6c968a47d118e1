"""What the port serves so Llama 3, Mixtral and DeepSeek-V2 train without TE or apex
(the rocm_port package's norms, grouped GEMM, FP8 switch-off, TE names), checked against references
written here: fp64 formulas for RMSNorm/LayerNorm with and without zero-centered gamma, a
per-expert loop in fp64 for grouped GEMM. The tests that need upstream's own classes (MLA's
core attention) are in test_serve_models_fullclone.py."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from support.port import load as _load  # noqa: E402


def _after_import(rp, module) -> None:
    """What the port's after-import finder runs once ``module`` has loaded (TE absent)."""
    for step in rp.after_import_steps(module.__name__):
        step(module)


@pytest.fixture()
def rp():
    module = _load(None)
    yield module
    module.uninstall_import_blocker()


def _config(normalization="RMSNorm", centered=False, **extra):
    return types.SimpleNamespace(normalization=normalization, layernorm_zero_centered_gamma=centered,
                                 sequence_parallel=False, **extra)


def ref_rms_norm(x, gamma, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma.double()


def ref_layer_norm(x, gamma, beta, eps):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma.double() + beta.double()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("centered", [False, True])
def test_norm_matches_the_formula(rp, dtype, normalization, centered):
    torch.manual_seed(0)
    norm = rp.Norm(_config(normalization, centered), 48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48) * 0.1)
        if norm.bias is not None:
            norm.bias.copy_(torch.randn(48) * 0.1)
    norm = norm.to(dtype)
    x = (torch.randn(5, 3, 48) * 3 + 1).to(dtype)
    gamma = norm.weight.double() + (1.0 if centered else 0.0)
    if normalization == "RMSNorm":
        assert norm.bias is None
        want = ref_rms_norm(x, gamma, 1e-6)
    else:
        want = ref_layer_norm(x, gamma, norm.bias, 1e-6)
    got = norm(x)
    assert got.dtype == dtype
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * want.abs().max().item()


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_zero_centered_gamma_stores_gamma_minus_one(rp, normalization):
    """As TE: the centered norm starts at weight 0 (gamma 1) and adds 1 in fp32, so a bf16 weight of
    1e-3 is not lost to bf16's rounding of 1 + 1e-3."""
    centered = rp.Norm(_config(normalization, True), 16)
    plain = rp.Norm(_config(normalization, False), 16)
    assert torch.equal(centered.weight, torch.zeros(16)) and torch.equal(plain.weight, torch.ones(16))
    x = torch.randn(4, 16)
    assert torch.equal(centered(x), plain(x))
    with torch.no_grad():
        centered.weight.fill_(1e-3)
    centered = centered.to(torch.bfloat16)
    y = centered(x.to(torch.bfloat16)).double()
    gamma = torch.full((16,), 1.0 + float(torch.tensor(1e-3, dtype=torch.bfloat16)), dtype=torch.float64)
    want = ref_rms_norm(x, gamma, 1e-5) if normalization == "RMSNorm" else ref_layer_norm(
        x, gamma, torch.zeros(16), 1e-5)
    assert (y - want).abs().max().item() <= 8e-3 * want.abs().max().item()


def test_norm_gradients_match_autograd_of_the_formula(rp):
    torch.manual_seed(1)
    norm = rp.Norm(_config("RMSNorm", True), 8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8) * 0.1)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    norm(x).pow(2).sum().backward()
    w = norm.weight.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref_rms_norm(x2, w + 1, 1e-6).pow(2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(norm.weight.grad, w.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_norm_keeps_the_formula_forward_and_backward(rp, monkeypatch, capsys, dtype):
    """Where compiling is on (a GPU with Triton; forced here: inductor writes C++ on a CPU), the
    port's norm runs as compiled kernels, forward and backward, with the eager path's values."""
    monkeypatch.setenv(rp.softmax._COMPILE_ENV, "1")
    monkeypatch.setattr(rp.softmax, "_COMPILED", {})
    monkeypatch.setattr(rp.say, "_SAID", set())
    torch._dynamo.reset()
    torch.manual_seed(3)
    for normalization in ("RMSNorm", "LayerNorm"):
        norm = rp.Norm(_config(normalization, True), 32, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(32) * 0.1)
        norm = norm.to(dtype)
        x = (torch.randn(6, 2, 32) * 2 + 0.5).to(dtype).requires_grad_(True)
        g = torch.randn(6, 2, 32).to(dtype)
        compiled = norm(x)
        compiled.backward(g)
        grads = [x.grad.clone()] + [p.grad.clone() for p in norm.parameters()]
        x.grad = None
        norm.zero_grad(set_to_none=True)
        monkeypatch.setenv(rp.softmax._COMPILE_ENV, "0")
        eager = norm(x)
        eager.backward(g)
        monkeypatch.setenv(rp.softmax._COMPILE_ENV, "1")
        tol = TOL[dtype] * 4
        assert compiled.dtype == dtype
        assert (compiled.double() - eager.double()).abs().max().item() <= tol * eager.double().abs().max().item()
        for got, want in zip(grads, [x.grad] + [p.grad for p in norm.parameters()]):
            assert (got.double() - want.double()).abs().max().item() <= tol * want.double().abs().max().item()
    assert sorted(key[2] for key in rp.softmax._COMPILED) == ["LayerNorm", "RMSNorm"]
    assert all(fn is not None for fn in rp.softmax._COMPILED.values())
    assert capsys.readouterr().out.count("> ROCm port: norm: each pass compiled into one kernel") == 1


def test_norm_compile_failure_runs_the_eager_norm_with_one_line(rp, monkeypatch, capsys):
    monkeypatch.setenv(rp.softmax._COMPILE_ENV, "1")
    monkeypatch.setattr(rp.softmax, "_COMPILED", {})
    monkeypatch.setattr(rp.say, "_SAID", set())

    def broken(*args, **kwargs):
        raise RuntimeError("no working Triton here")

    monkeypatch.setattr(torch, "compile", broken)
    norm = rp.Norm(_config("RMSNorm"), 8, eps=1e-6)
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x).double(), ref_rms_norm(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6)
    norm(x)  # not tried again
    assert list(rp.softmax._COMPILED.values()) == [None]
    assert capsys.readouterr().out.count("> ROCm port: norm: compiling failed (RuntimeError: no working Triton") == 1


def test_unknown_normalization_is_one_line_error(rp):
    with pytest.raises(ValueError, match="L2Norm") as info:
        rp.Norm(_config("L2Norm"), 8)
    assert "\n" not in str(info.value)


def _upstream_like_fused_layer_norm():
    """A class shaped like upstream's apex FusedLayerNorm: it asserts LayerNorm in __init__."""

    class FusedLayerNorm(torch.nn.Module):
        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=True, zero_centered_gamma=False,
                     normalization="LayerNorm"):
            super().__init__()
            assert config.normalization == "LayerNorm", f"({config.normalization}) is not supported in FusedLayerNorm"
            self.hidden_size = hidden_size

    return FusedLayerNorm


def test_apex_layer_norm_builds_the_port_norm_for_rms_norm_only(rp):
    module = types.SimpleNamespace(FusedLayerNorm=_upstream_like_fused_layer_norm())
    rp.te_features._serve_rms_norm_in_fused_layer_norm(module)
    rms = module.FusedLayerNorm(config=_config("RMSNorm"), hidden_size=8, eps=1e-6)
    assert isinstance(rms, rp.Norm) and rms.normalization == "RMSNorm" and rms.eps == 1e-6
    layer = module.FusedLayerNorm(_config("LayerNorm"), 8)
    assert type(layer) is module.FusedLayerNorm and layer.hidden_size == 8


def _upstream_te_norm():
    """upstream's TENorm wrapper without TE (megatron/core/extensions/transformer_engine.py)."""
    class TENorm:
        def __new__(cls, config, hidden_size, eps=1e-5):
            raise ImportError("Transformer Engine is not installed. Please install it with "
                              "`pip install transformer-engine`.")

    TENorm.__module__ = "megatron.core.extensions.transformer_engine"
    return TENorm


def test_a_block_that_bound_upstreams_te_norm_builds_the_port_norm(rp):
    """The nano-v3-vl snapshot's transformer block imports TENorm unguarded (the extension module
    imports without TE) and makes it its LayerNormImpl: no model built without TE, ported or not."""
    te_norm = _upstream_te_norm()
    block = types.SimpleNamespace(TENorm=te_norm, LayerNormImpl=te_norm, __name__="megatron.core.transformer."
                                                                                   "transformer_block")
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        block.LayerNormImpl(_config("RMSNorm"), 8)
    rp.te_features._te_norm_is_the_port_norm(block)
    assert block.TENorm is rp.Norm and block.LayerNormImpl is rp.Norm
    norm = block.LayerNormImpl(config=_config("RMSNorm", False), hidden_size=8, eps=1e-6)
    assert isinstance(norm, rp.Norm) and norm.normalization == "RMSNorm"


def test_a_module_s_own_norm_implementation_is_left_alone(rp):
    """Where LayerNormImpl is not TE's (apex's, torch's), the port's step leaves it."""
    class WrappedTorchNorm:
        pass

    block = types.SimpleNamespace(LayerNormImpl=WrappedTorchNorm, __file__=None)
    rp.te_features._te_norm_is_the_port_norm(block)
    assert block.LayerNormImpl is WrappedTorchNorm


def test_torch_norm_builds_the_port_norm_for_zero_centered_gamma(rp):
    class WrappedTorchNorm:
        def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                    normalization="LayerNorm"):
            assert not config.layernorm_zero_centered_gamma, "zero_centered_gamma not supported by torch LayerNorm"
            return torch.nn.RMSNorm(hidden_size, eps=eps)

    module = types.SimpleNamespace(WrappedTorchNorm=WrappedTorchNorm)
    rp.te_features._serve_zero_centered_gamma_in_torch_norm(module)
    centered = module.WrappedTorchNorm(config=_config("RMSNorm", True, persist_layer_norm=False,
                                                      memory_efficient_layer_norm=False), hidden_size=8)
    assert isinstance(centered, rp.Norm) and centered.zero_centered_gamma
    plain = module.WrappedTorchNorm(_config("RMSNorm", False, persist_layer_norm=False), 8)
    assert isinstance(plain, torch.nn.RMSNorm)


def test_torch_layer_norm_of_core_09_takes_persist_on_and_builds_rms_norm(rp, capsys):
    """core 0.9 … 0.12's WrappedTorchLayerNorm asserts in ``__init__`` (LayerNorm only, no persist
    flag): upstream's default persist_layer_norm is ignored there even though the port gives the
    class a ``__new__`` of its own for RMSNorm (the two wrappers in the other order let the assert
    through: every core 0.9-0.12 run died of it)."""
    class WrappedTorchLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                     normalization="LayerNorm"):
            self.config = config
            assert not config.layernorm_zero_centered_gamma
            assert not self.config.persist_layer_norm, "persist_layer_norm not supported by torch LayerNorm"
            assert config.normalization == "LayerNorm", f"({config.normalization}) is not supported"
            super().__init__(hidden_size, eps=eps)

    module = types.SimpleNamespace(WrappedTorchLayerNorm=WrappedTorchLayerNorm)
    rp.te_features._serve_zero_centered_gamma_in_torch_norm(module)
    plain = module.WrappedTorchLayerNorm(_config("LayerNorm", False, persist_layer_norm=True), 8)
    assert type(plain) is WrappedTorchLayerNorm
    assert "persist_layer_norm" in capsys.readouterr().out
    rms = module.WrappedTorchLayerNorm(_config("RMSNorm", False, persist_layer_norm=True), 8)
    assert isinstance(rms, rp.Norm) and rms.normalization == "RMSNorm"


def test_te_norm_names_resolve_to_the_port_norm(rp, capsys):
    guarded = types.ModuleType("megatron.core.transformer.transformer_block")
    guarded.TENorm = None
    undefined = types.ModuleType("megatron.core.models.gpt.moe_module_specs")
    kept = types.ModuleType("megatron.core.transformer.attention")
    kept.TENorm = object
    for module in (guarded, undefined, kept):
        _after_import(rp, module)
    assert guarded.TENorm is rp.Norm and undefined.TENorm is rp.Norm and kept.TENorm is object
    assert capsys.readouterr().out.count("> ROCm port: TransformerEngine is not installed: TENorm") == 1


def ref_gmm(a, b, sizes, trans_b):
    out, start = [], 0
    for e, n in enumerate(sizes):
        w = b[e].double()
        out.append(a[start:start + n].double() @ (w.t() if trans_b else w))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_is_a_per_expert_matmul(rp, trans_b, dtype):
    torch.manual_seed(2)
    sizes = [3, 0, 5, 1]
    a = torch.randn(sum(sizes), 6).to(dtype).requires_grad_(True)
    b = (torch.randn(4, 7, 6) if trans_b else torch.randn(4, 6, 7)).to(dtype).requires_grad_(True)
    got = rp.grouped_gemm.ops.gmm(a, b, torch.tensor(sizes), trans_b=trans_b)
    want = ref_gmm(a.detach(), b.detach(), sizes, trans_b)
    assert got.shape == (9, 7) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()
    g = torch.randn(9, 7).to(dtype)
    got.backward(g)
    a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    ref_gmm(a64, b64, sizes, trans_b).backward(g.double())
    assert (a.grad.double() - a64.grad).abs().max().item() <= tol * a64.grad.abs().max().item()
    assert (b.grad.double() - b64.grad).abs().max().item() <= tol * b64.grad.abs().max().item()
    assert torch.equal(b.grad[1], torch.zeros_like(b.grad[1]))  # the expert with no tokens


def test_grouped_gemm_rejects_sizes_that_do_not_split_the_rows(rp):
    with pytest.raises(ValueError, match="do not split") as info:
        rp.grouped_gemm.ops.gmm(torch.zeros(4, 2), torch.zeros(2, 2, 3), torch.tensor([1, 2]))
    assert "\n" not in str(info.value)


def test_grouped_gemm_util_gets_the_port_gmm_only_without_the_package(rp, capsys):
    missing = types.SimpleNamespace(grouped_gemm=None, ops=None)
    rp.te_features._serve_grouped_gemm(missing)
    assert missing.grouped_gemm is rp.grouped_gemm and missing.ops is rp.grouped_gemm.ops
    installed = types.SimpleNamespace(grouped_gemm=object(), ops="theirs")
    rp.te_features._serve_grouped_gemm(installed)
    assert installed.ops == "theirs"
    assert capsys.readouterr().out == ""  # said when it first runs, not at import
    rp.grouped_gemm.ops.gmm(torch.zeros(1, 2), torch.zeros(1, 2, 3), [1])
    rp.grouped_gemm.ops.gmm(torch.zeros(1, 2), torch.zeros(1, 2, 3), [1])
    assert capsys.readouterr().out.count("> ROCm port: --moe-grouped-gemm needs the grouped_gemm package") == 1


def test_fp8_is_switched_off_with_one_line_before_validation(rp, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    seen = []
    module = types.SimpleNamespace(validate_args=lambda args, defaults={}: seen.append((args.fp8, args.fp8_param_gather)))
    rp.te_features._fp8_off_before_validation(module)
    for _ in range(2):
        args = types.SimpleNamespace(fp8="hybrid", fp8_recipe="delayed", fp8_param_gather=True, bf16=True, fp16=False)
        module.validate_args(args, {})
    assert seen == [(None, False), (None, False)]
    out = capsys.readouterr().out.splitlines()
    assert out == ["> ROCm port: --fp8-format hybrid (--fp8-recipe delayed) needs TransformerEngine, which is not "
                   "installed: switched off, training runs in bf16"]


def test_no_fp8_says_nothing(rp, capsys):
    args = types.SimpleNamespace(fp8=None, bf16=True)
    assert rp.switch_off_fp8(args) is False and capsys.readouterr().out == ""


class _FakeColumnParallelLinear(torch.nn.Module):
    """Shaped like upstream's ColumnParallelLinear: (input_size, output_size, *, config, ...)."""

    def __init__(self, input_size, output_size, *, config, bias=False, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(output_size, input_size, dtype=torch.float64))

    def forward(self, x):
        return x @ self.weight.t(), None


def _fake_backends():
    module = types.ModuleType("megatron.core.models.backends")

    class LocalSpecProvider:
        def column_parallel_layer_norm_linear(self):
            return None

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            return "SequentialMLP"

    module.LocalSpecProvider = LocalSpecProvider
    module.ColumnParallelLinear = _FakeColumnParallelLinear
    module.get_backend = lambda impl: f"upstream {impl}"
    return module


def test_te_backend_without_te_is_local_with_the_port_norm_then_linear(rp, capsys):
    module = _fake_backends()
    _after_import(rp, module)
    assert module.get_backend("local") == "upstream local"
    backend = module.get_backend("transformer_engine")
    assert isinstance(backend, module.LocalSpecProvider)
    fused = backend.column_parallel_layer_norm_linear()
    assert issubclass(fused, _FakeColumnParallelLinear)
    config = _config("RMSNorm", True, layernorm_epsilon=1e-6)
    layer = fused(8, 5, config=config, init_method=None, gather_output=False)
    with torch.no_grad():
        layer.layer_norm.weight.copy_(torch.linspace(-0.2, 0.2, 8))
    x = torch.randn(3, 8, dtype=torch.float64)
    out, _ = layer(x)
    want = ref_rms_norm(x, layer.layer_norm.weight.detach().double() + 1, 1e-6) @ layer.weight.detach().t()
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    assert backend.grouped_mlp_modules(True) == "SequentialMLP"
    assert "experts run as upstream's SequentialMLP" in capsys.readouterr().out


def test_mla_duplicated_down_projection_is_column_parallel_at_tp1_only(rp):
    module = types.ModuleType("megatron.core.transformer.multi_latent_attention")
    built = []
    module.build_module = lambda spec, *args, **kwargs: built.append((spec, args, kwargs))
    _after_import(rp, module)
    tp1 = types.SimpleNamespace(tensor_model_parallel_size=1)
    module.build_module(_FakeColumnParallelLinear, 8, 4, parallel_mode="duplicated", config=tp1)
    assert built[-1][2] == {"config": tp1, "gather_output": False}
    with pytest.raises(ValueError, match="tensor-parallel size 2") as info:
        module.build_module(_FakeColumnParallelLinear, 8, 4, parallel_mode="duplicated",
                            config=types.SimpleNamespace(tensor_model_parallel_size=2))
    assert "\n" not in str(info.value)

    class TakesMode:
        def __init__(self, *args, parallel_mode=None, **kwargs):
            pass

    module.build_module(TakesMode, 8, 4, parallel_mode="duplicated", config=tp1)
    assert built[-1][2]["parallel_mode"] == "duplicated"  # a linear that takes it keeps it


def test_mla_module_with_mocked_te_gets_have_te_false(rp):
    module = types.ModuleType("megatron.core.transformer.multi_latent_attention")
    module.HAVE_TE = True
    _after_import(rp, module)
    assert module.HAVE_TE is False


def test_router_gemm_helper_left_undefined_is_none(rp):
    module = types.ModuleType("megatron.core.transformer.moe.moe_utils")
    _after_import(rp, module)
    assert module.te_general_gemm is None and not hasattr(module, "TENorm")


def test_port_norm_and_baseline_shim_norm_agree(rp):
    """Two implementations written apart (the port's and the te-norm baseline shim's) of TE's norm."""
    from megaport.train.shims import te_norm

    for normalization in ("RMSNorm", "LayerNorm"):
        config = _config(normalization, True)
        port, shim = rp.Norm(config, 32), te_norm.TENormInTorch(config, 32)
        with torch.no_grad():
            for p in (port.weight, shim.weight):
                p.copy_(torch.linspace(-0.3, 0.3, 32))
        x = torch.randn(6, 32).to(torch.bfloat16)
        assert torch.equal(port.to(torch.bfloat16)(x), shim.to(torch.bfloat16)(x)), normalization


def test_port_gmm_and_baseline_shim_gmm_agree(rp):
    from megaport.train.shims import grouped_gemm_loop

    a, b = torch.randn(7, 4), torch.randn(3, 4, 5)
    assert torch.equal(rp.grouped_gemm.ops.gmm(a, b, torch.tensor([2, 0, 5])), grouped_gemm_loop.gmm(a, b, [2, 0, 5]))


def test_baseline_shim_builds_torch_norm_only_where_it_refuses():
    from megaport.train.shims import te_norm

    class WrappedTorchNorm:
        def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
            assert not config.layernorm_zero_centered_gamma, "zero_centered_gamma not supported by torch LayerNorm"
            return torch.nn.RMSNorm(hidden_size, eps=eps)

    module = types.SimpleNamespace(WrappedTorchNorm=WrappedTorchNorm)
    te_norm.torch_norms(module)
    assert isinstance(module.WrappedTorchNorm(_config("RMSNorm", False), 8), torch.nn.RMSNorm)
    assert isinstance(module.WrappedTorchNorm(_config("RMSNorm", True), 8), te_norm.TENormInTorch)


def test_the_distributed_optimizer_steps_without_te_where_fp8_utils_refused_an_empty_shard(rp):
    """Upstream 2025-04 … 07 (062c833392 to 76203e757e): without TE, fp8_utils' fallback
    quantize_param_shard raised on every distributed-optimizer step, FP8 parameters or none. With
    the port it returns where there is nothing to quantize and still refuses FP8 parameters."""
    module = types.ModuleType("megatron.core.fp8_utils")

    def _quantize_param_shard_impl(*args, **kwargs):
        raise RuntimeError("Invalid Transformer Engine version for FP8 distributed optimizer")

    module._quantize_param_shard_impl = _quantize_param_shard_impl
    _after_import(rp, module)
    _after_import(rp, module)  # a second load wraps nothing twice
    assert module._quantize_param_shard_impl([], [], [], None) is None
    with pytest.raises(RuntimeError, match="Invalid Transformer Engine version"):
        module._quantize_param_shard_impl([torch.zeros(1)], [], [], None)
    assert module._quantize_param_shard_impl.__wrapped__ is _quantize_param_shard_impl


def test_a_distributed_checkpoint_loads_without_te_where_the_fp8_fix_asked_its_version(rp, capsys):
    """Upstream 2025-04 (062c833392 to 72afd63ccb) and core 0.12: loading any torch_dist
    checkpoint first called is_te_min_version("2.0"), which imports TE: every layout comparison
    and resume of core-0.10-0.12's newest ref died of ModuleNotFoundError before the port's step."""
    module = types.ModuleType("megatron.training.checkpointing")

    def fix_fp8_params_lose_precision_when_loading_dist_ckpt(state_dict):
        import transformer_engine  # noqa: F401  (what upstream's is_te_min_version does first)

    module.fix_fp8_params_lose_precision_when_loading_dist_ckpt = fix_fp8_params_lose_precision_when_loading_dist_ckpt
    with pytest.raises(ModuleNotFoundError):
        module.fix_fp8_params_lose_precision_when_loading_dist_ckpt({"model": {}})
    _after_import(rp, module)
    _after_import(rp, module)  # a second load wraps nothing twice
    state = {"model": {"weight": torch.ones(2)}}
    assert module.fix_fp8_params_lose_precision_when_loading_dist_ckpt(state) is None
    assert torch.equal(state["model"]["weight"], torch.ones(2))
    assert "loads without the FP8 parameter fix" in capsys.readouterr().out
