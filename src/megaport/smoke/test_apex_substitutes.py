"""The apex substitutes the tree uses, against plain PyTorch references, on the verify device.

Every test finds its subject in the tree: rocm_port's FusedAdam/FusedSGD/amp_C/
multi_tensor_applier/FusedLayerNormAffineFunction/fused_weight_gradient_mlp_cuda (the port is the
same in every era, so a name missing there fails), and upstream's own modules as each era has
them (megatron.core.optimizer's fallbacks, the FusedLayerNorm module): one the tree lacks fails
when the unported upstream commit has it, and skips, with upstream's word, when the era has none.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest

from megaport import cpu_substitutions
from megaport.smoke import _era, _guard, _locate, _verdicts

torch = pytest.importorskip("torch")


port_name = _verdicts.port_name  # rocm_port's names: missing is a broken port
era_name = _era.era_name  # upstream's names: missing fails where upstream has it
era_module = _era.era_module  # upstream's modules: the same


def params_and_grads(device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    params = [torch.randn(s, generator=gen).to(dtype).to(device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype).to(device) for s in shapes] for _ in range(3)]
    return params, grads


def run_steps(optimizer_cls, params, grads, **kwargs):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = optimizer_cls(ps, **kwargs)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def assert_same_params(got, want, what, atol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= atol, f"{what}: parameter {i} differs from plain PyTorch by {err:.3g}"


# ---------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------


def test_rocm_port_fused_adam_is_adamw(rocm_port, device):
    fused_adam = port_name(rocm_port, "FusedAdam")
    params, grads = params_and_grads(device)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # apex-only arguments that upstream passes must be accepted
    got = run_steps(fused_adam, params, grads, bias_correction=True, adam_w_mode=True, set_grad_none=True, **kwargs)
    want = run_steps(torch.optim.AdamW, params, grads, **kwargs)
    assert_same_params(got, want, "rocm_port.FusedAdam vs torch.optim.AdamW")


def test_rocm_port_fused_sgd_is_sgd(rocm_port, device):
    fused_sgd = port_name(rocm_port, "FusedSGD")
    params, grads = params_and_grads(device, seed=1)
    kwargs = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    got = run_steps(fused_sgd, params, grads, wd_after_momentum=False, **kwargs)
    want = run_steps(torch.optim.SGD, params, grads, **kwargs)
    assert_same_params(got, want, "rocm_port.FusedSGD vs torch.optim.SGD")


def test_megatron_core_optimizer_fallback_matches_adamw(smoke, device):
    """megatron.core.optimizer's Adam (TE → apex → torch fallback) is apex-free and steps like AdamW."""
    module = era_module(smoke, "megatron.core.optimizer", "megatron.optimizer")
    adam = era_name(smoke, module, "Adam")
    origin = getattr(adam, "__module__", "") or ""
    assert not origin.startswith("apex"), f"megatron.core.optimizer.Adam is apex's ({origin})"
    params, grads = params_and_grads(device, seed=2)
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    got = run_steps(adam, params, grads, **kwargs)
    want = run_steps(torch.optim.AdamW, params, grads, **kwargs)
    assert_same_params(got, want, f"megatron.core.optimizer.Adam ({origin}) vs torch.optim.AdamW", atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Grad-norm and grad-scale helpers (amp_C and multi_tensor_applier)
# ---------------------------------------------------------------------------------------------


IMPLEMENTATIONS = ["rocm_port.amp_C", "clip_grads"]


def multi_tensor_helpers(smoke, which, rocm_port):
    """(applier, l2norm, scale) of rocm_port's amp_C stand-in or of what clip_grads bound."""
    if which == "rocm_port.amp_C":
        amp_c = port_name(rocm_port, "amp_C")
        return port_name(rocm_port, "multi_tensor_applier"), amp_c.multi_tensor_l2norm, amp_c.multi_tensor_scale
    clip = era_module(smoke, "megatron.core.optimizer.clip_grads", "megatron.optimizer.clip_grads")
    applier = era_name(smoke, clip, "multi_tensor_applier")
    if hasattr(clip, "l2_norm_impl"):  # core >= 0.8: TE → apex → megatron.core.utils fallbacks
        return applier, clip.l2_norm_impl, era_name(smoke, clip, "multi_tensor_scale_impl")
    amp_c = era_name(smoke, clip, "amp_C", "l2_norm_impl")  # older eras bind amp_C itself
    return applier, amp_c.multi_tensor_l2norm, amp_c.multi_tensor_scale


def call_or_skip_cuda_only(smoke, fn, *args, **kwargs):
    """Upstream helpers that allocate on 'cuda' run with their tensors placed on the CPU there
    (the substitution is reported); anything else CUDA-only skips, naming the line."""
    placement = contextlib.nullcontext()
    if not smoke.gpu:
        placement = cpu_substitutions.install(torch, "placement")
        placement.tell(smoke.facts.setdefault("grad_helpers_cpu_substitutions", []))
    try:
        with placement:
            return fn(*args, **kwargs)
    except (AssertionError, RuntimeError) as exc:
        reason = _verdicts.cuda_only_reason(exc, smoke.tree)
        if reason and not smoke.gpu:
            pytest.skip(reason)
        raise


@pytest.mark.parametrize("which", IMPLEMENTATIONS)
def test_grad_norm_helper_matches_torch(smoke, rocm_port, device, which):
    applier, l2norm, _ = multi_tensor_helpers(smoke, which, rocm_port)
    label = f"{which} ({getattr(l2norm, '__module__', '?')}.{getattr(l2norm, '__name__', '?')})"
    origin = getattr(l2norm, "__module__", "") or ""
    assert not _guard.is_blocked(origin), f"{label} comes from {origin}"
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(s, generator=gen).to(device) for s in ((64, 3), (17,), (5, 5, 5))]
    tensors.append(torch.randn(33, generator=gen).to(torch.bfloat16).to(device))
    want_total = torch.stack([t.double().norm() for t in tensors]).norm().item()
    flag = torch.zeros(1, dtype=torch.int, device=device)
    total, per_tensor = call_or_skip_cuda_only(smoke, applier, l2norm, flag, [tensors], True)
    got = float(total.reshape(-1)[0])
    assert abs(got - want_total) <= 1e-5 * want_total, f"{label}: l2 norm {got} vs torch {want_total}"
    want_each = torch.stack([t.double().norm() for t in tensors]).cpu()
    assert torch.allclose(per_tensor.double().cpu().reshape(-1), want_each, rtol=1e-5), f"{label}: per-tensor norms"
    assert int(flag.item()) == 0, f"{label}: finite norms raised the overflow flag"


@pytest.mark.parametrize("which", IMPLEMENTATIONS)
def test_grad_scale_helper_matches_torch(smoke, rocm_port, device, which):
    applier, _, scale_op = multi_tensor_helpers(smoke, which, rocm_port)
    gen = torch.Generator().manual_seed(4)
    src = [torch.randn(s, generator=gen).to(device) for s in ((9, 4), (31,))]
    want = [t * 0.25 for t in src]
    if which == "rocm_port.amp_C":
        dst = [torch.empty_like(t) for t in src]  # apex's contract: any source and destination lists
        lists = [src, dst]
    else:
        dst = src  # how clip_grads calls it: in place, [grads, grads]
        lists = [src, src]
    flag = torch.zeros(1, dtype=torch.int, device=device)
    call_or_skip_cuda_only(smoke, applier, scale_op, flag, lists, 0.25)
    for w, d in zip(want, dst):
        assert torch.allclose(d, w, rtol=1e-6, atol=0), f"{which}: multi_tensor_scale result"
    assert int(flag.item()) == 0, f"{which}: finite values raised the overflow flag"
    if which == "rocm_port.amp_C":
        # apex's amp_C raises the flag on non-finite values; upstream's local fallback does not
        # (Megatron checks for inf/nan separately then).
        bad = [torch.tensor([1.0, float("inf")], device=device)]
        flag.zero_()
        applier(scale_op, flag, [bad, [torch.empty_like(bad[0])]], 1.0)
        assert int(flag.item()) != 0, f"{which}: an inf gradient did not raise the overflow flag"


def test_optimizer_copies_main_params_to_model_params(smoke, device):
    """Float16OptimizerWithFloat16Params copies fp32 main params into fp16 model params through
    _multi_tensor_copy_this_to_that with an overflow buffer: the grad-scale kernel, with two lists."""
    module = era_module(smoke, "megatron.core.optimizer.optimizer", "megatron.optimizer.optimizer")
    copy = era_name(smoke, module, "_multi_tensor_copy_this_to_that")
    gen = torch.Generator().manual_seed(10)
    this = [torch.randn(s, generator=gen).to(device) for s in ((6, 5), (11,))]
    that = [torch.zeros(t.shape, dtype=torch.float16, device=device) for t in this]
    overflow_buf = torch.tensor([0], dtype=torch.int, device=device)
    try:
        call_or_skip_cuda_only(smoke, copy, this, that, overflow_buf)  # v2.0 allocates torch.cuda.IntTensor
    except RuntimeError as exc:
        pytest.fail(f"the fp16 optimizer's main->model parameter copy fails: {exc} "
                    f"({_locate.tree_frame(exc, smoke.tree)})", pytrace=False)
    for a, b in zip(this, that):
        assert torch.equal(b, a.half()), "main->model parameter copy gave other values"


def test_megatron_grad_norm_fp32(smoke, device, process_group):
    """clip_grads.get_grad_norm_fp32 (upstream's own, through the fallbacks) against torch."""
    clip = era_module(smoke, "megatron.core.optimizer.clip_grads", "megatron.optimizer.clip_grads")
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(s, generator=gen).to(device) for s in ((10, 3), (7,))]
    want = torch.stack([g.double().norm() for g in grads]).norm().item()
    if hasattr(clip, "get_grad_norm_fp32"):
        got = float(call_or_skip_cuda_only(smoke, clip.get_grad_norm_fp32, grads, 2))
        assert abs(got - want) <= 1e-5 * want, f"get_grad_norm_fp32 {got} vs torch {want}"
        return
    fn = era_name(smoke, clip, "clip_grad_norm_fp32", "get_grad_norm_fp32")
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    # Upstream's get_model marks every parameter's tensor-parallel attributes; v2.0 reads them unguarded.
    layers = era_module(smoke, "megatron.core.tensor_parallel.layers", "megatron.mpu.layers")
    mark = era_name(smoke, layers, "set_defaults_if_not_set_tensor_model_parallel_attributes")
    for p, g in zip(params, grads):
        mark(p)
        p.grad = g.clone()
    # Its arguments changed over the eras: (parameters, max_norm) until 2022, then grads_for_norm
    # after the parameters, then check_for_nan_in_grad after max_norm (2023-10 on).
    accepts = inspect.signature(fn).parameters
    args = [params] + ([[p.grad for p in params]] if "grads_for_norm" in accepts else []) + [1.0]
    kwargs = {"check_for_nan_in_grad": True} if "check_for_nan_in_grad" in accepts else {}
    got = float(call_or_skip_cuda_only(smoke, fn, *args, **kwargs))
    assert abs(got - want) <= 1e-5 * want, f"clip_grad_norm_fp32 returned {got}, torch's norm is {want}"
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * (1.0 / (want + 1e-6)), rtol=1e-5), "gradients not clipped to norm 1"


# ---------------------------------------------------------------------------------------------
# Layer norm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_id", ["fp32", "bf16"])
def test_layer_norm_affine_function_matches_torch(smoke, rocm_port, device, dtype_id):
    """The FusedLayerNormAffineFunction the tree's fused_layer_norm module uses (fwd and bwd)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_id]
    module, _ = _locate.import_first(("megatron.core.fusions.fused_layer_norm", "megatron.model.fused_layer_norm",
                                      "megatron.legacy.model.fused_layer_norm"))
    fn = getattr(module, "FusedLayerNormAffineFunction", None) if module else None
    fn = fn or port_name(rocm_port, "FusedLayerNormAffineFunction")
    if module is not None and getattr(module, "fused_mix_prec_layer_norm_cuda", False) is None:
        # 2021-2023 trees bind the layer-norm extension (the port's stand-in) into a module global
        # when the first MixedFusedLayerNorm is built; the function is only ever called after that.
        module.MixedFusedLayerNorm(32)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 6, 32, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype).to(device)
    b = (0.1 * torch.randn(32, generator=gen)).to(dtype).to(device)
    g = torch.randn(4, 6, 32, generator=gen).to(dtype).to(device)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = fn.apply(leaves[0], leaves[1], leaves[2], (32,), 1e-5)
    y.backward(g)
    refs = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y_ref = torch.nn.functional.layer_norm(refs[0], (32,), refs[1], refs[2], 1e-5)
    y_ref.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert y.dtype == dtype
    assert torch.allclose(y.float(), y_ref.float(), atol=tol), "layer norm forward"
    for name, a, r in zip(("input", "weight", "bias"), leaves, refs):
        assert torch.allclose(a.grad.float(), r.grad.float(), atol=tol * 10, rtol=tol), f"layer norm grad of {name}"


LAYER_NORM_MODULES = ("megatron.core.fusions.fused_layer_norm", "megatron.model.fused_layer_norm",
                      "megatron.legacy.model.fused_layer_norm")


def _layer_norm_module(smoke, module, device):
    """The era's fused layer-norm module, 32 wide, built the way its constructor takes it: a
    TransformerConfig from core 0.4 on, keyword arguments before (MixedFusedLayerNorm until
    2023, FusedLayerNorm of megatron/core/fusions in 2023)."""
    cls = era_name(smoke, module, "FusedLayerNorm", "MixedFusedLayerNorm")
    accepts = inspect.signature(cls.__init__).parameters
    kwargs = {"eps": 1e-5}
    kwargs["hidden_size" if "hidden_size" in accepts else "normalized_shape"] = 32
    if "config" in accepts:
        tc = era_module(smoke, "megatron.core.transformer.transformer_config")
        kwargs["config"] = tc.TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                                use_cpu_initialization=True)
    try:
        return cls(**kwargs).to(device)
    except ValueError as exc:
        pytest.fail(f"{module.__name__}.{cls.__name__} needs apex in this tree: {exc}", pytrace=False)


def test_fused_layer_norm_module_matches_torch(smoke, device):
    """Every fused layer-norm module the tree has (megatron/core/fusions, megatron/model,
    megatron/legacy/model) builds without apex and matches torch's LayerNorm, forward and backward."""
    from megaport.smoke._fork import set_default_args

    set_default_args(smoke.tree)  # the DeepSpeed fork's layer norms read Megatron's global args
    # Which of them the era has is upstream's answer: one the port lost fails in era_module.
    names = [n for n in LAYER_NORM_MODULES if smoke.era_has(_locate.module_path(n)[0])]
    if not names:
        pytest.fail(f"the era has none of {', '.join(LAYER_NORM_MODULES)}", pytrace=False)
    for name in names:
        layer = _layer_norm_module(smoke, era_module(smoke, name), device)
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.1, 0.1)
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(5, 2, 32, generator=gen).to(device).requires_grad_(True)
        xr = x.detach().clone().requires_grad_(True)
        y = layer(x)
        y_ref = torch.nn.functional.layer_norm(xr, (32,), layer.weight.detach(), layer.bias.detach(), 1e-5)
        assert torch.allclose(y, y_ref, atol=1e-5), f"{name}: forward"
        y.sum().backward()
        y_ref.sum().backward()
        assert torch.allclose(x.grad, xr.grad, atol=1e-5), f"{name}: input gradient"


def test_mix_prec_layer_norm_stand_in_matches_autograd(rocm_port, device):
    """Old eras call apex's fused_mix_prec_layer_norm_cuda.forward_affine/backward_affine directly."""
    ext = port_name(rocm_port, "fused_mix_prec_layer_norm_cuda")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 16, generator=gen, dtype=torch.float64).to(device)
    w = torch.randn(16, generator=gen, dtype=torch.float64).to(device)
    b = torch.randn(16, generator=gen, dtype=torch.float64).to(device)
    g = torch.randn(6, 16, generator=gen, dtype=torch.float64).to(device)
    out, mean, invvar = ext.forward_affine(x, (16,), w, b, 1e-5)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y_ref = torch.nn.functional.layer_norm(leaves[0], (16,), leaves[1], leaves[2], 1e-5)
    y_ref.backward(g)
    assert torch.allclose(out, y_ref.detach(), atol=1e-10)
    gi, gw, gb = ext.backward_affine(g, mean, invvar, x, (16,), w, b, 1e-5)
    for name, a, r in zip(("input", "weight", "bias"), (gi, gw, gb), leaves):
        assert torch.allclose(a, r.grad, atol=1e-10), f"backward_affine grad of {name}"


# ---------------------------------------------------------------------------------------------
# Gradient-accumulation fusion
# ---------------------------------------------------------------------------------------------


@pytest.mark.in_upstream("gradient_accumulation_fusion", *_locate.TP_LAYERS)  # 2022-02 on
@pytest.mark.parametrize("main_grad_dtype", ["fp32", "bf16"])
def test_weight_gradient_accumulation_matches_matmul(smoke, rocm_port, device, main_grad_dtype):
    """The wgrad_gemm_accum functions tensor_parallel/layers.py calls: main_grad += g^T x."""
    layers = era_module(smoke, "megatron.core.tensor_parallel.layers", "megatron.mpu.layers")
    ext = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    if ext is None and "rocm_port import fused_weight_gradient_mlp_cuda" in inspect.getsource(layers):
        ext = port_name(rocm_port, "fused_weight_gradient_mlp_cuda")  # 2022's layers import it inside backward
    if ext is None or not getattr(layers, "_grad_accum_fusion_available", True):
        pytest.fail("tensor_parallel.layers has no gradient-accumulation fusion: "
                    "the default --gradient-accumulation-fusion would raise", pytrace=False)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[main_grad_dtype]
    fn = ext.wgrad_gemm_accum_fp32 if dtype == torch.float32 else ext.wgrad_gemm_accum_fp16
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 4, 12, generator=gen).to(dtype).to(device)
    g = torch.randn(3, 4, 10, generator=gen).to(dtype).to(device)
    main_grad = torch.zeros(10, 12, dtype=dtype, device=device)
    fn(x, g, main_grad)
    fn(x, g, main_grad)
    want = 2 * g.reshape(-1, 10).double().t() @ x.reshape(-1, 12).double()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (main_grad.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), (
        "gradient accumulation: main_grad != sum of grad_output^T @ input")
