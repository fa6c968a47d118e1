"""Run inside a fresh interpreter against a ported tree: imports and softmax numerics.

Usage: python ported_check.py TREE FAKES_DIR   → prints one JSON line of findings.

FAKES_DIR holds stand-ins for apex, amp_C and the fused *_cuda extensions that raise when
imported: if the ported tree let any of them through, the import crashes (upstream only catches
ImportError), exactly as a real apex would be picked up on a machine that has it installed.
The softmax reference here is written from the CUDA kernels' semantics in fp64, independently of
the code under test.
"""

from __future__ import annotations

import json
import sys

BLOCKED_ROOTS = ("apex", "amp_C")


def blocked_modules_loaded() -> list[str]:
    return sorted(
        name for name in sys.modules if name.split(".")[0] in BLOCKED_ROOTS or name.split(".")[0].endswith("_cuda")
    )


def reference(x, scale, mask, causal, zero_fully_masked):
    """fp64 softmax as the kernels compute it: masked → -10000.0 (unscaled), rest x*scale."""
    import torch

    z = x.double() * scale
    if causal:
        sq, sk = z.shape[-2], z.shape[-1]
        future = torch.triu(torch.ones(sq, sk, dtype=torch.bool), diagonal=1)
        z = z.masked_fill(future, float("-inf"))
    if mask is not None:
        z = z.masked_fill(mask, -10000.0)
    y = torch.softmax(z, dim=-1)
    if mask is not None and zero_fully_masked:
        y = y.masked_fill(mask.all(dim=-1, keepdim=True).expand_as(y), 0.0)
    return y


def reference_grad(y, g, scale):
    y, g = y.double(), g.double()
    return scale * (y * g - y * (y * g).sum(-1, keepdim=True))


def check_softmax(fused_softmax, torch, zero_fully_masked: bool) -> dict:
    torch.manual_seed(0)
    findings = {}
    b, heads, sq, sk, scale = 2, 4, 32, 32, 0.125
    cases = {
        "upper_triang": (fused_softmax.ScaledUpperTriangMaskedSoftmax, (b * heads, sq, sk), None, True),
        "masked": (fused_softmax.ScaledMaskedSoftmax, (b, heads, sq, sk), "mask", False),
        "plain": (fused_softmax.ScaledSoftmax, (b, heads, sq, sk), None, False),
    }
    for name, (fn, shape, use_mask, causal) in cases.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(shape, dtype=torch.float32).to(dtype).requires_grad_(True)
            mask = None
            args = (x, scale)
            if use_mask:
                mask = torch.rand(b, 1, sq, sk) < 0.3
                mask[0, 0, 3, :] = True  # one fully masked row
                args = (x, mask, scale)
            y = fn.apply(*args)
            g = torch.randn(shape).to(dtype)
            y.backward(g)
            ref = reference(x.detach(), scale, mask, causal, zero_fully_masked)
            ref_grad = reference_grad(ref, g, scale)
            findings[f"{name}/{str(dtype)[6:]}"] = {
                "dtype_kept": y.dtype == dtype,
                "fwd_err": float((y.double() - ref).abs().max()),
                "bwd_err": float((x.grad.double() - ref_grad).abs().max() / (ref_grad.abs().max() + 1e-12)),
                "causal_zeros": bool((y.detach()[..., torch.triu(torch.ones(sq, sk, dtype=torch.bool), 1)] == 0).all())
                if causal
                else None,
                "masked_row": y.detach()[0, 0, 3].double().tolist()[:4] if use_mask else None,
            }
    return findings


def main() -> None:
    tree, fakes = sys.argv[1], sys.argv[2]
    sys.path[:0] = [tree, fakes]
    try:
        check()
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top == "megatron" or top in BLOCKED_ROOTS or top.endswith("_cuda"):
            raise
        # Upstream's own third-party needs (triton since core 0.18) are not megaport's to supply.
        print(json.dumps({"missing_dependency": top}))


def check() -> None:
    import torch

    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.fusions.fused_layer_norm as fused_layer_norm
    import megatron.core.tensor_parallel.layers as layers

    imported = ["fused_softmax", "fused_layer_norm", "tensor_parallel.layers"]
    try:
        import megatron.core.optimizer  # noqa: F401  (absent before core 0.6)

        imported.append("optimizer")
    except ModuleNotFoundError as exc:
        if exc.name != "megatron.core.optimizer":
            raise
    from megatron.core import rocm_port

    module = fused_softmax.FusedScaleMaskSoftmax
    x = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    ln = fused_layer_norm.FusedLayerNormAffineFunction.apply(x, weight, bias, (6,), 1e-5)
    ln_ref = torch.nn.functional.layer_norm(x, (6,), weight, bias, 1e-5)
    main_grad = torch.zeros(5, 6)
    total_input, grad_output = torch.randn(7, 6), torch.randn(7, 5)
    layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    result = {
        "imported": imported,
        "blocked_loaded": blocked_modules_loaded(),
        "softmax_is_port": fused_softmax.ScaledMaskedSoftmax is rocm_port.ScaledMaskedSoftmax,
        "batch_per_block": module.get_batch_per_block(1024, 1024, 2, 16),
        "grad_accum_fusion_available": bool(getattr(layers, "_grad_accum_fusion_available", False)),
        "wgrad_err": float((main_grad - grad_output.t() @ total_input).abs().max()),
        "layer_norm_err": float((ln - ln_ref).abs().max()),
        "fully_masked_zero": rocm_port.FULLY_MASKED_ROWS_ARE_ZERO,
        "softmax": check_softmax(fused_softmax, torch, rocm_port.FULLY_MASKED_ROWS_ARE_ZERO),
        "blocked_loaded_after": blocked_modules_loaded(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
