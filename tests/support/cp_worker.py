"""One CP rank of tests/test_context_parallel.py: a gloo process that runs every case's
context-parallel attention on its load-balanced chunks and saves its output and gradients.

Spawned (torch.multiprocessing), so it imports only torch and loads the module under test from
its file, as the trees it is copied into do."""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def load(path: str):
    spec = importlib.util.spec_from_file_location("_megaport_context_parallel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def global_inputs(case: dict):
    """The case's whole-sequence q, k, v, output gradient and mask (fp64, the same on every rank)."""
    s, b, heads, groups, dk, dv = (case[n] for n in ("seq", "batch", "heads", "groups", "dk", "dv"))
    g = torch.Generator().manual_seed(case["seed"])
    q, k = torch.randn(s, b, heads, dk, generator=g, dtype=torch.float64), \
        torch.randn(s, b, groups, dk, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, groups, dv, generator=g, dtype=torch.float64)
    grad = torch.randn(s, b, heads * dv, generator=g, dtype=torch.float64)
    mask = None
    if case.get("mask"):  # True = masked; rows 0 and 3 of batch 0 fully masked
        mask = torch.rand(b, 1, s, s, generator=g) < 0.4
        mask[0, :, [0, 3]] = True
    return q, k, v, grad, mask


def run(rank: int, world: int, port: int, path: str, cases: list, outdir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    cp = load(path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for case in cases:
            q, k, v, grad, mask = global_inputs(case)
            dtype = DTYPES[case.get("dtype", "float64")]
            local = [cp.split_for_cp_rank(t, rank, world).to(dtype).requires_grad_() for t in (q, k, v)]
            local_mask = None if mask is None else cp.split_for_cp_rank(mask, rank, world, seq_dim=2)
            torch.manual_seed(case["seed"])  # the dropout seed the test draws again
            out = cp.context_parallel_attention(*local, group=dist.group.WORLD, scale=case.get("scale"),
                                                causal=case["causal"], dropout_p=case.get("dropout", 0.0),
                                                attn_mask=local_mask, _fault=case.get("fault"))
            out.backward(cp.split_for_cp_rank(grad, rank, world).to(dtype))
            result = {"out": out.detach()}
            result.update({n: t.grad for n, t in zip(("dq", "dk", "dv"), local)})
            torch.save(result, os.path.join(outdir, f"{case['name']}.{rank}.pt"))
    finally:
        dist.destroy_process_group()
