"""One rank of the distributed smoke test, started by torch.distributed.run (torchrun).

Usage (test_distributed.py builds this): python -m torch.distributed.run --standalone
--nproc-per-node 2 _dist_worker.py --tree DIR --out DIR --device cpu|cuda|hip --backend NAME
--wgrad-fusion yes|no

Writes OUT/rank<N>.json: the backend used and one entry per check, {"ok": bool, "detail": str},
with "missing_dependency": [verdict, line] where tree code needed a third-party package this
machine lacks. Every check runs the tree's own code; nothing here stands in for it. What the era
expects of gradient-accumulation fusion (--wgrad-fusion) is decided by the caller from the
unported upstream commit, never from the tree's source.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path


def _blocked_loaded():
    from megaport.smoke import _guard

    return _guard.blocked_modules_loaded()


_TREE: list = []  # the tree under test, for failure()


def failure(exc: BaseException) -> dict:
    """A check's entry for ``exc``; a third-party package the machine lacks carries the suite's
    one line for it (megaport.smoke._verdicts.missing_dependency)."""
    entry = {"ok": False, "detail": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    from megaport.smoke import _verdicts

    judged = _verdicts.missing_dependency(exc, _TREE[0]) if _TREE else None
    if judged is not None:
        entry["missing_dependency"] = list(judged)
    return entry


def check(results, name):
    """Decorator: run one check, record ok/detail, or the exception."""

    def wrap(fn):
        try:
            out = fn()
            results[name] = out if isinstance(out, dict) else {"ok": True, "detail": str(out or "")}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = failure(exc)
        return fn

    return wrap


def max_err(a, b):
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def _arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", required=True, help="--distributed-backend value (resolved by the tree)")
    parser.add_argument("--wgrad-fusion", choices=("yes", "no"), required=True,
                        help="whether the era's tensor-parallel backward fuses the wgrad GEMM (from upstream)")
    return parser.parse_args()


def _tree_rocm_port(results: dict):
    """The tree's rocm_port and its backend resolver. A tree without it, or without the resolver, is
    a broken port (reported under "rocm_port"; every test fails with it), never a run "as given"."""
    from megaport.smoke import _locate

    rocm_port, resolve = None, None
    try:
        rocm_port, why = _locate.import_first(_locate.ROCM_PORT_MODULES)
        resolve = getattr(rocm_port, "resolve_distributed_backend", None)
        if rocm_port is None:
            results["rocm_port"] = {"ok": False, "detail": f"the tree has no rocm_port module ({why})"}
        elif resolve is None:
            results["rocm_port"] = {"ok": False, "detail": f"{rocm_port.__name__} has no resolve_distributed_backend: "
                                                           "the port is the same in every era, so it is broken"}
        else:
            results["rocm_port"] = {"ok": True, "detail": rocm_port.__name__}
    except Exception as exc:  # noqa: BLE001 - reported to the tests
        results["rocm_port"] = failure(exc)
    return rocm_port, resolve


def _start_process_group(results, torch, dist, args, rank, local_rank):
    """Resolve the backend through the tree's port, pick the device and join the group: the device."""
    rocm_port, resolve = _tree_rocm_port(results)
    backend = resolve(args.backend, rank=rank) if resolve else args.backend
    results["backend"] = {"requested": args.backend, "torch_backend": backend,
                          "resolved_by": "rocm_port.resolve_distributed_backend" if resolve else "none (as given)"}
    device = torch.device("cpu")
    if args.device != "cpu":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if rocm_port is not None and hasattr(rocm_port, "collective_library"):
            results["backend"]["library"] = list(rocm_port.collective_library())
    else:
        # CPU tensors: the groups the tree creates with an explicit nccl backend (2025's pipeline
        # groups) are gloo's too, as in the CPU training run.
        from megaport import cpu_substitutions

        cpu_substitutions.install(torch, "process-group")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=90))
    results["backend"]["initialised"] = dist.get_backend()
    return device


def _collectives(results, torch, dist, rank, world, device) -> None:
    """all-reduce (fp32, int64, bf16) and broadcast, which must be exact."""

    @check(results, "all_reduce")
    def _():
        t = torch.arange(1, 1025, dtype=torch.float32, device=device) * (rank + 1)
        dist.all_reduce(t)
        factor = sum(r + 1 for r in range(world))
        want = torch.arange(1, 1025, dtype=torch.float32) * factor
        ok = torch.equal(t.cpu(), want)
        ints = torch.full((7,), rank + 1, dtype=torch.int64, device=device)
        dist.all_reduce(ints)
        ok_int = bool((ints.cpu() == factor).all())
        bf = torch.full((33,), 0.5 * (rank + 1), dtype=torch.bfloat16, device=device)
        dist.all_reduce(bf)
        ok_bf = bool((bf.float().cpu() == 0.5 * factor).all())
        return {"ok": ok and ok_int and ok_bf, "detail": f"fp32 exact {ok}, int64 exact {ok_int}, bf16 exact {ok_bf}"}

    @check(results, "broadcast")
    def _():
        t = (torch.arange(513, dtype=torch.float32, device=device) * 3.25 + 1) if rank == 0 else \
            torch.zeros(513, dtype=torch.float32, device=device)
        dist.broadcast(t, src=0)
        want = torch.arange(513, dtype=torch.float32) * 3.25 + 1
        return {"ok": torch.equal(t.cpu(), want), "detail": "rank 0's tensor bit for bit"}


def _finish(dist) -> None:
    try:
        dist.barrier()
    finally:
        try:
            _parallel_modules()[0].destroy_model_parallel()
        except Exception:  # noqa: BLE001
            pass
        dist.destroy_process_group()


def main() -> int:
    args = _arguments()
    tree = Path(args.tree)
    _TREE.append(tree)
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    results: dict = {"rank": rank, "world_size": world}
    if args.device == "cpu":
        # Before the tree's first import: a fork tree builds CUDA tensors at import.
        from megaport import cpu_substitutions

        cpu_substitutions.install(torch, "fork-checks", tree=tree)
    device = _start_process_group(results, torch, dist, args, rank, int(os.environ.get("LOCAL_RANK", rank)))
    _collectives(results, torch, dist, rank, world, device)
    try:
        tp = _tensor_parallel(results, torch, dist, rank, world, device, tree, args.wgrad_fusion == "yes")
    except Exception as exc:  # noqa: BLE001 - the layers could not even be built: each check fails with it
        failed = failure(exc)
        tp = {name: failed for name in ("column_parallel_linear", "row_parallel_linear", "gradient_accumulation_fusion")}
    results["tensor_parallel"] = tp
    results["blocked_loaded"] = _blocked_loaded()
    _finish(dist)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


def _parallel_modules():
    """(model-parallel state, tensor-parallel layers) of the tree: megatron.core's from 2022-11,
    megatron.mpu's (the same functions and layers) before."""
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import layers
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("megatron.core"):
            raise
        from megatron import mpu
        from megatron.mpu import layers

        return mpu, layers
    return parallel_state, layers


def _layer_settings(torch, world):
    """A function ``settings(cls, **extra)`` giving the keyword arguments that make the
    tensor-parallel layer ``cls``: fp32 weights initialised on the CPU, no sequence parallelism,
    ``extra`` on top. Each era takes its settings its own way: a ModelParallelConfig (2023-07 on),
    keyword arguments of each layer (2022-11 to 2023-07), or Megatron's global args (megatron.mpu,
    until 2022-11)."""
    import inspect

    settings = dict(use_cpu_initialization=True, perform_initialization=True, params_dtype=torch.float32,
                    gradient_accumulation_fusion=False, async_tensor_model_parallel_allreduce=False,
                    no_async_tensor_model_parallel_allreduce=True, sequence_parallel=False,
                    sequence_parallel_enabled=False)
    try:
        from megatron.core.model_parallel_config import ModelParallelConfig
    except ModuleNotFoundError:
        ModelParallelConfig = None

    def config(cls, **extra):
        chosen = {k: settings[k] for k in ("use_cpu_initialization", "perform_initialization", "params_dtype")}
        return {"config": ModelParallelConfig(tensor_model_parallel_size=world, **chosen, **extra)}

    def keywords(cls, **extra):
        accepts = inspect.signature(cls.__init__).parameters
        return {k: v for k, v in {**settings, **extra}.items() if k in accepts}

    def global_args(cls, **extra):
        import argparse

        from megatron import global_vars

        global_vars._GLOBAL_ARGS = argparse.Namespace(**{**settings, **extra})
        return {}

    def settings_for(cls, **extra):
        accepts = inspect.signature(cls.__init__).parameters
        if ModelParallelConfig is not None and "config" in accepts:
            return config(cls, **extra)
        return (keywords if "use_cpu_initialization" in accepts else global_args)(cls, **extra)

    return settings_for


def _tensor_parallel(results, torch, dist, rank, world, device, tree, era_fuses_wgrad):
    """ColumnParallelLinear → RowParallelLinear at TP=world against the unsharded layers; with
    gradient-accumulation fusion on, the wgrad lands in main_grad where the era fuses it
    (``era_fuses_wgrad``, from upstream), in weight.grad where the era never does."""
    from types import SimpleNamespace

    from megaport.smoke._fork import set_default_args

    parallel_state, layers = _parallel_modules()
    parallel_state.initialize_model_parallel(world)
    set_default_args(tree)  # the DeepSpeed fork's layers also read Megatron's global args
    run = SimpleNamespace(torch=torch, dist=dist, rank=rank, world=world, device=device, layers=layers,
                          settings=_layer_settings(torch, world), hidden=8, ffn=3 * world, out_dim=4)
    run.shard = slice(rank * (run.ffn // world), (rank + 1) * (run.ffn // world))
    _sharded_forward_backward(run)
    _unsharded_forward_backward(run)
    status = {}
    check(status, "column_parallel_linear")(lambda: _compare(run, {
        "forward": (run.y, run.yr[..., run.shard]), "weight_grad": (run.col.weight.grad, run.w1.grad[run.shard]),
        "bias_grad": (run.col.bias.grad, run.b1.grad[run.shard]), "input_grad": (run.x.grad, run.xr.grad)}))
    check(status, "row_parallel_linear")(lambda: _compare(run, {
        "forward": (run.z, run.zr), "weight_grad": (run.row.weight.grad, run.w2.grad[:, run.shard]),
        "bias_grad": (run.row.bias.grad, run.b2.grad)}))
    check(status, "gradient_accumulation_fusion")(lambda: _wgrad_accumulation(run, era_fuses_wgrad))
    return status


def _init(torch):
    return lambda w: torch.nn.init.normal_(w, std=0.2)


def _sharded_forward_backward(run) -> None:
    """The tree's ColumnParallelLinear → RowParallelLinear, forward and backward on this rank."""
    torch, layers = run.torch, run.layers
    torch.manual_seed(1234)
    run.col = layers.ColumnParallelLinear(run.hidden, run.ffn, **run.settings(layers.ColumnParallelLinear),
                                          init_method=_init(torch), bias=True, gather_output=False).to(run.device)
    run.row = layers.RowParallelLinear(run.ffn, run.out_dim, **run.settings(layers.RowParallelLinear),
                                       init_method=_init(torch), bias=True, input_is_parallel=True,
                                       skip_bias_add=False).to(run.device)
    gen = torch.Generator().manual_seed(99)
    run.x = torch.randn(3, 5, run.hidden, generator=gen).to(run.device).requires_grad_(True)
    run.g = torch.randn(3, 5, run.out_dim, generator=gen).to(run.device)
    run.y, _ = run.col(run.x)
    run.z, _ = run.row(run.y)
    run.z.backward(run.g)


def _unsharded_forward_backward(run) -> None:
    """The same two layers unsharded, from the gathered shards: plain torch, fp32."""
    torch = run.torch

    def gather(t, dim):
        parts = [torch.empty_like(t) for _ in range(run.world)]
        run.dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    run.w1 = gather(run.col.weight.detach(), 0).requires_grad_(True)
    run.b1 = gather(run.col.bias.detach(), 0).requires_grad_(True)
    run.w2 = gather(run.row.weight.detach(), 1).requires_grad_(True)
    run.b2 = run.row.bias.detach().clone().requires_grad_(True)
    run.xr = run.x.detach().clone().requires_grad_(True)
    run.yr = torch.nn.functional.linear(run.xr, run.w1, run.b1)
    run.zr = torch.nn.functional.linear(run.yr, run.w2, run.b2)
    run.zr.backward(run.g)


def _compare(run, pairs: dict, tol: float = 1e-5) -> dict:
    errs = {name: max_err(got, want) for name, (got, want) in pairs.items()}
    return {"ok": all(e <= tol for e in errs.values()), "detail": ", ".join(f"{k} {v:.2g}" for k, v in errs.items())}


def _wgrad_accumulation(run, era_fuses_wgrad: bool) -> dict:
    """The default --gradient-accumulation-fusion path: wgrad accumulated into main_grad."""
    torch, layers, shard = run.torch, run.layers, run.ffn // run.world
    with_fusion = run.settings(layers.ColumnParallelLinear, gradient_accumulation_fusion=True)
    fused = layers.ColumnParallelLinear(run.hidden, run.ffn, **with_fusion, init_method=_init(torch), bias=False,
                                        gather_output=False).to(run.device)
    with torch.no_grad():
        fused.weight.copy_(run.col.weight)
    fused.weight.main_grad = torch.zeros(fused.weight.shape, dtype=torch.float32, device=run.device)
    xa = run.x.detach().clone().requires_grad_(True)
    for _ in range(2):
        ya, _unused = fused(xa)
        ya.backward(torch.ones_like(ya))
    want = 2 * torch.ones(3 * 5, shard, dtype=torch.float64).t() @ run.x.detach().double().cpu().reshape(-1, run.hidden)
    if not era_fuses_wgrad:
        # The DeepSpeed fork commented the fused path out at its 2023-07 merge (upstream's own
        # layers, not a patch): the flag does nothing there, and weight.grad takes the gradient
        # as without it.
        err = max_err(fused.weight.grad, want)
        untouched = float(fused.weight.main_grad.abs().max()) == 0.0
        return {"ok": err <= 1e-4 and untouched,
                "detail": f"the era's layers never fuse (upstream's fused path commented out): weight.grad error "
                          f"{err:.2g} after 2 micro-batches; main_grad untouched: {untouched}"}
    err = max_err(fused.weight.main_grad, want)
    no_grad = fused.weight.grad is None
    return {"ok": err <= 1e-4 and no_grad,
            "detail": f"main_grad error {err:.2g} after 2 micro-batches; weight.grad is None: {no_grad}"}


if __name__ == "__main__":
    sys.exit(main())
