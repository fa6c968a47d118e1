"""Run inside a fresh interpreter against a ported tree: imports and softmax numerics.

Usage: python ported_check.py TREE FAKES_DIR zero|uniform   → prints one JSON line of findings.

The third argument is the era's kernel semantics for fully masked rows, from the catalogue.

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
    """Blocked modules really loaded: the port marks them absent with None in sys.modules (so a
    find_spec probe hears "not installed"), which is no module."""
    return sorted(
        name for name, module in list(sys.modules.items()) if module is not None
        and (name.split(".")[0] in BLOCKED_ROOTS or name.split(".")[0].endswith("_cuda"))
    )


def reference(x, scale, mask, causal, fully_masked_rows_are_zero):
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
    if mask is not None and fully_masked_rows_are_zero:
        y = y.masked_fill(mask.all(dim=-1, keepdim=True).expand_as(y), 0.0)
    return y


def reference_grad(y, g, scale):
    y, g = y.double(), g.double()
    return scale * (y * g - y * (y * g).sum(-1, keepdim=True))


def check_softmax(fused_softmax, torch, fully_masked_rows_are_zero: bool) -> dict:
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
            ref = reference(x.detach(), scale, mask, causal, fully_masked_rows_are_zero)
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


def first_module(*names: str):
    """The first of ``names`` that the tree has: module paths moved between eras."""
    import importlib

    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
    return None


def main() -> None:
    tree, fakes, semantics = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path[:0] = [tree, fakes]
    try:
        check(fully_masked_rows_are_zero=semantics == "zero")
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top == "megatron" or top in BLOCKED_ROOTS or top.endswith("_cuda"):
            raise
        # Upstream's own third-party needs (triton since core 0.18) are not megaport's to supply.
        print(json.dumps({"missing_dependency": top}))


def check(fully_masked_rows_are_zero: bool) -> None:
    import torch

    rocm_port = first_module("megatron.core.rocm_port", "megatron.rocm_port")
    fused_softmax = first_module(
        "megatron.core.fusions.fused_softmax", "megatron.legacy.model.fused_softmax", "megatron.model.fused_softmax"
    )
    layers = first_module("megatron.core.tensor_parallel.layers")
    optimizer = first_module("megatron.core.optimizer")
    imported = [m.__name__ for m in (rocm_port, fused_softmax, layers, optimizer) if m is not None]

    module = fused_softmax.FusedScaleMaskSoftmax
    x = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    ln = rocm_port.FusedLayerNormAffineFunction.apply(x, weight, bias, (6,), 1e-5)
    ln_ref = torch.nn.functional.layer_norm(x, (6,), weight, bias, 1e-5)
    result = {
        "imported": imported,
        "blocked_loaded": blocked_modules_loaded(),
        "softmax_is_port": fused_softmax.ScaledMaskedSoftmax is rocm_port.ScaledMaskedSoftmax,
        "batch_per_block": module.get_batch_per_block(1024, 1024, 2, 16) if hasattr(module, "get_batch_per_block") else None,
        "layer_norm_err": float((ln - ln_ref).abs().max()),
        "fully_masked_zero": rocm_port.FULLY_MASKED_ROWS_ARE_ZERO,
        "softmax": check_softmax(fused_softmax, torch, fully_masked_rows_are_zero),
    }
    if layers is not None:
        main_grad = torch.zeros(5, 6)
        total_input, grad_output = torch.randn(7, 6), torch.randn(7, 5)
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
        result["grad_accum_fusion_available"] = bool(getattr(layers, "_grad_accum_fusion_available", False))
        result["wgrad_err"] = float((main_grad - grad_output.t() @ total_input).abs().max())
    result["blocked_loaded_after"] = blocked_modules_loaded()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
