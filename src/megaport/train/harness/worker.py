"""The harness's fresh interpreter: a few training steps through upstream's megatron.core builders.

Started by :mod:`megaport.train.harness.launcher` with the tree first on sys.path, so two trees
never share a process:

    python -m megaport.train.harness --tree DIR --mode ported|fusions-off [--device cpu|cuda] ...

It prints one JSON document on its last line of stdout.

What it builds is what upstream's training builds from megatron.core. Where the tree has
megatron/training, upstream's own ``parse_args`` and ``validate_args`` run on the flags of the
GPT-3 example script (shrunk, mock data and the NullTokenizer; see megaport.train.example) and
``core_transformer_config_from_args`` builds the TransformerConfig; elsewhere a TransformerConfig
with upstream's CLI defaults is built here. Then the GPT layer spec of the era's default
``--transformer-impl`` (TransformerEngine's, which the port serves with local layers; the local one
with fusions off), GPTModel, megatron.core's DistributedDataParallel with an fp32 gradient buffer,
and the optimizer from ``get_megatron_optimizer`` (from the parsed arguments where there are some).

Modes:
- ``ported``: upstream's CLI defaults, i.e. every fusion on (masked softmax, bias-GeLU,
  bias-dropout-add, persistent layer norm, gradient-accumulation fusion, RoPE fusion) and the
  era's default ``--transformer-impl`` (see default_transformer_impl).
- ``fusions-off``: what a ROCm user without megaport runs: ``--no-masked-softmax-fusion
  --no-gradient-accumulation-fusion --no-persist-layer-norm --no-bias-dropout-fusion
  --no-rope-fusion`` with the local transformer implementation (bias-GeLU stays on: upstream's
  torch.jit code, another function than the unfused GELU; see example.FUSIONS_OFF_FLAGS).

The harness sets its own learning rate, seed and dropout 0 (it is not upstream's entry point, and
its loss must fall within a dozen steps). On CPU, upstream's CUDA-only plumbing gets the smallest
substitutions, each reported under ``substitutions`` (the ``placement`` and ``megatron-plumbing``
profiles of :mod:`megaport.cpu_substitutions`): tensors it places on 'cuda' go to the CPU, the
global memory buffer allocates on the CPU and the CUDA RNG tracker's fork() is a no-op (dropout is
0, so no random numbers are drawn in it). No code the port changed is substituted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import resource
import statistics
import sys
import time

from megaport import cpu_substitutions
from megaport.train import example
from megaport.train import failure
from megaport.train.process_group import one_rank_group

MODES = ("ported", "fusions-off")
FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_gelu_fusion", "bias_dropout_fusion",
           "persist_layer_norm", "gradient_accumulation_fusion", "apply_rope_fusion")
#: on in both modes: upstream's fused bias-GeLU (the harness's GPT is a GELU model), as the parser's
#: runs keep it (example.FUSIONS_OFF_FLAGS says why)
UPSTREAMS_OWN = ("bias_activation_fusion", "bias_gelu_fusion")


@dataclasses.dataclass
class HarnessRun(example.Sizes):
    """Sizes and schedule of one run; the defaults are a tiny model that trains in seconds on CPU."""

    tree: str = ""
    mode: str = "ported"
    device: str = "cpu"
    batch: int = 4
    steps: int = 12
    vocab: int = 128  # the harness's own batches
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 1234
    dtype: str = "bf16"
    position_embedding: str = "learned_absolute"


def _filtered(cls, wanted: dict) -> dict:
    """The entries of ``wanted`` that ``cls`` (a dataclass or callable) accepts in this era."""
    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls)}
    else:
        known = set(inspect.signature(cls).parameters)
    return {k: v for k, v in wanted.items() if k in known}


def _batches(run: HarnessRun, torch):
    """Mock data, the same for every tree: runs of consecutive tokens with random starts, which a
    model learns within a few steps (so the loss falls), one fresh batch per step."""
    gen = torch.Generator().manual_seed(run.seed)
    steps = torch.arange(run.seq + 1)
    for _ in range(run.steps):
        start = torch.randint(0, run.vocab, (run.batch, 1), generator=gen)
        stride = torch.randint(1, 4, (run.batch, 1), generator=gen)
        seqs = (start + stride * steps) % run.vocab
        yield seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def upstream_args(run: HarnessRun, facts: dict):
    """Upstream's own parse_args + validate_args on the shrunk example flags, or None for trees
    without megatron/training (PyPI's megatron-core before 0.17)."""
    try:
        arguments = importlib.import_module("megatron.training.arguments")
    except ModuleNotFoundError as exc:
        if exc.name and "megatron.training".startswith(exc.name):
            return None
        raise
    if not hasattr(arguments, "core_transformer_config_from_args"):
        return None
    tokens, source = example.example_flags(run.tree)
    flags = example.shrunk(tokens, run, data=example.mock_data(run))
    flags += ["--lr", str(run.lr), "--seed", str(run.seed), "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
    flags += example.FUSIONS_OFF_FLAGS if run.mode == "fusions-off" else []
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py"] + flags
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # parse_args prints every argument
            args = arguments.parse_args(ignore_unknown_args=True)
            arguments.validate_args(args, {})
    finally:
        sys.argv = saved
    facts["upstream_parser"] = {"flags": flags, "from": source, "transformer_impl": args.transformer_impl}
    return args, arguments


def _ddp_module():
    """megatron.core.distributed where the era's DDP (with main_grad buffers) feeds megatron.core's
    optimizer: from core 0.7 with its DDP config, in 0.6 with explicit arguments; else None (0.5
    has the DDP but no megatron.core optimizer to take its main_grad buffers)."""
    try:
        module = importlib.import_module("megatron.core.distributed")
    except ModuleNotFoundError:
        return None
    if hasattr(module, "DistributedDataParallelConfig"):
        return module
    try:
        optimizer = importlib.import_module("megatron.core.optimizer")
    except ModuleNotFoundError:
        return None
    return module if hasattr(module, "DistributedDataParallel") and hasattr(optimizer, "OptimizerConfig") else None


def _config(run: HarnessRun, torch, facts: dict):
    tc = importlib.import_module("megatron.core.transformer.transformer_config")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[run.dtype]
    on = run.mode == "ported"
    wanted = dict(
        num_layers=run.layers, hidden_size=run.hidden, num_attention_heads=run.heads,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=run.dtype == "bf16", params_dtype=dtype, pipeline_dtype=dtype,
        **{name: on or name in UPSTREAMS_OWN for name in FUSIONS},
    )
    if not on:
        wanted["apply_rope_fusion"] = False
    if _ddp_module() is None:  # the fusion accumulates into DDP's main_grad buffers
        wanted["gradient_accumulation_fusion"] = False
        facts["gradient_accumulation_fusion"] = "off: this era's megatron.core has no DDP with main_grad buffers"
    accepted = _filtered(tc.TransformerConfig, wanted)
    facts["fusions"] = {k: v for k, v in accepted.items() if k in FUSIONS}
    config = tc.TransformerConfig(**accepted)
    # What __post_init__ or the port switched off, e.g. RoPE fusion without TransformerEngine.
    facts["fusions_after_config"] = {k: getattr(config, k) for k in facts["fusions"]}
    return config, dtype


_IMPL_DEFAULT = re.compile(
    r"""--transformer-impl['"],\s*default=['"](\w+)|transformer_impl:[^=\n]*=\s*['"](\w+)""")


def default_transformer_impl(tree: str) -> tuple[str, str]:
    """(upstream's default ``--transformer-impl`` for this tree, where that came from).

    Read from the tree's argument definitions; PyPI's megatron-core has none, and then the era
    tells: the eras that import TransformerEngine unguarded (2023-07 to 2024-06) defaulted to
    'local', later ones to 'transformer_engine'.
    """
    from megaport.train.example import ARGUMENT_FILES, CONFIG_FILES

    for rel in (*ARGUMENT_FILES, *CONFIG_FILES):
        path = os.path.join(tree, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                match = _IMPL_DEFAULT.search(f.read())
            if match:
                return match.group(1) or match.group(2), rel
    rocm_port = sys.modules.get("megatron.core.rocm_port")
    if rocm_port is not None and not getattr(rocm_port, "TRANSFORMER_ENGINE_IMPORTS_GUARDED", True):
        return "local", "the era (TransformerEngine imported unguarded; no arguments.py in the tree)"
    return "transformer_engine", "the era (no arguments.py in the tree)"


def _layer_spec(run: HarnessRun, facts: dict, impl_from_args=None):
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    if impl_from_args:
        impl, source = impl_from_args, "upstream's parser"
    elif run.mode == "fusions-off":
        impl, source = "local", "--transformer-impl local (fusions off)"
    else:
        impl, source = default_transformer_impl(run.tree)
    facts["transformer_impl_default"] = {"value": impl, "from": source}
    if impl == "transformer_engine" and hasattr(
            specs, "get_gpt_layer_with_transformer_engine_spec"):
        facts["layer_spec"] = "get_gpt_layer_with_transformer_engine_spec (upstream's default transformer_impl)"
        return specs.get_gpt_layer_with_transformer_engine_spec()
    facts["layer_spec"] = "get_gpt_layer_local_spec"
    return specs.get_gpt_layer_local_spec()


def _wrap_ddp(config, model, facts: dict):
    """megatron.core's DDP with an fp32 gradient buffer (main_grad), where the era has its config."""
    ddp_mod = _ddp_module()
    if ddp_mod is None:
        facts["ddp"] = "none in this era: plain autograd gradients"
        return model, False
    settings = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
    ddp_config_cls = getattr(ddp_mod, "DistributedDataParallelConfig", None)
    if ddp_config_cls is not None:
        chosen = dict(ddp_config=ddp_config_cls(**_filtered(ddp_config_cls, settings)))
    else:  # core 0.6: the same settings as arguments
        chosen = dict(accumulate_allreduce_grads_in_fp32=True, overlap_grad_reduce=False,
                      use_distributed_optimizer=False)
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    groups = dict(data_parallel_group=parallel_state.get_data_parallel_group())
    if hasattr(parallel_state, "get_data_modulo_expert_parallel_group"):
        groups["expert_data_parallel_group"] = parallel_state.get_data_modulo_expert_parallel_group()
    ddp = ddp_mod.DistributedDataParallel(**_filtered(ddp_mod.DistributedDataParallel, dict(
        config=config, module=model, **chosen, **groups)))
    facts["ddp"] = "megatron.core.distributed.DistributedDataParallel (fp32 grad buffer)"
    return ddp, True


def _optimizer(run: HarnessRun, model, dtype, facts: dict, torch, args=None):
    try:
        opt_mod = importlib.import_module("megatron.core.optimizer")
    except ModuleNotFoundError:
        opt_mod = None
    if opt_mod is None or not hasattr(opt_mod, "OptimizerConfig"):
        facts["optimizer"] = "torch.optim.Adam (this era's megatron.core has no optimizer builder)"
        return torch.optim.Adam(model.parameters(), lr=run.lr), False
    if args is not None:  # as upstream's setup_model_and_optimizer builds it
        fields = {f.name for f in dataclasses.fields(opt_mod.OptimizerConfig)}
        wanted = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    else:
        wanted = dict(optimizer="adam", lr=run.lr, min_lr=run.lr, weight_decay=0.01, adam_beta1=0.9,
                      adam_beta2=0.95, bf16=run.dtype == "bf16", params_dtype=dtype, clip_grad=1.0,
                      use_distributed_optimizer=False)
    config = opt_mod.OptimizerConfig(**_filtered(opt_mod.OptimizerConfig, wanted))
    optimizer = opt_mod.get_megatron_optimizer(config, [model])
    facts["optimizer"] = f"get_megatron_optimizer -> {type(optimizer).__name__}"
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        facts["optimizer"] += f" ({type(inner).__module__}.{type(inner).__name__})"
    return optimizer, True


def _peak_memory(torch, gpu: bool) -> int:
    if gpu:
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def train(run: HarnessRun) -> dict:
    """Build, train ``run.steps`` steps, and return losses, timings, memory and what was used."""
    import torch
    import torch.distributed as dist

    gpu = run.device != "cpu"
    facts: dict = {"mode": run.mode, "device": run.device, "substitutions": []}
    sys.path.insert(0, run.tree)
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    facts["megatron_core"] = sys.modules["megatron.core"].__file__
    if gpu:
        torch.cuda.set_device(0)
    with one_rank_group(dist, "nccl" if gpu else "gloo", prefix="megaport-gpt-"):
        parallel_state.initialize_model_parallel(1, 1)
        if gpu:
            tensor_parallel.model_parallel_cuda_manual_seed(run.seed)
        torch.manual_seed(run.seed)
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            return _train(run, torch, parallel_state, tensor_parallel, device, gpu, facts)
        with cpu_substitutions.install(torch, "placement", "megatron-plumbing") as substituted:
            substituted.tell(facts["substitutions"])
            return _train(run, torch, parallel_state, tensor_parallel, device, gpu, facts)


def _config_from_args(args, arguments, facts: dict):
    """TransformerConfig exactly as upstream's training builds it from its arguments."""
    config = arguments.core_transformer_config_from_args(args)
    facts["fusions"] = {k: getattr(config, k) for k in FUSIONS if hasattr(config, k)}
    facts["fusions_after_config"] = dict(facts["fusions"])
    return config, args.params_dtype


def _train(run, torch, parallel_state, tensor_parallel, device, gpu, facts) -> dict:
    parsed = upstream_args(run, facts)
    if parsed is not None:
        args, arguments = parsed
        config, dtype = _config_from_args(args, arguments, facts)
        run.dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
    else:
        config, dtype = _config(run, torch, facts)
    gpt = importlib.import_module("megatron.core.models.gpt.gpt_model")
    spec = _layer_spec(run, facts, parsed[0].transformer_impl if parsed else None)
    model = gpt.GPTModel(**_filtered(gpt.GPTModel, dict(
        config=config, transformer_layer_spec=spec, vocab_size=run.vocab, max_sequence_length=run.seq,
        position_embedding_type=run.position_embedding)))
    model = model.to(device=device, dtype=dtype)
    model, has_ddp = _wrap_ddp(config, model, facts)
    optimizer, megatron_optimizer = _optimizer(run, model, dtype, facts, torch, parsed[0] if parsed else None)

    if gpu:
        torch.cuda.reset_peak_memory_stats()
    losses, times, grad_norms = _steps(run, model, optimizer, has_ddp, megatron_optimizer, device, gpu, torch)
    timed = times[run.warmup:] or times
    ms = 1000 * statistics.median(timed)
    document = {
        "run": dataclasses.asdict(run),
        "losses": losses,
        "grad_norms": grad_norms,
        "ms_per_iter": ms,
        "tokens_per_s": run.batch * run.seq / (ms / 1000),
        "peak_memory_bytes": _peak_memory(torch, gpu),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if gpu else "process max RSS",
        "torch": torch.__version__,
        **facts,
    }
    return document


def _steps(run, model, optimizer, has_ddp, megatron_optimizer, device, gpu, torch):
    """The training steps, as upstream's schedule runs them at one micro-batch per step:
    (loss per step, seconds per step, grad norm per step: None where the optimizer gave none)."""
    position_ids = torch.arange(run.seq, device=device).unsqueeze(0).expand(run.batch, run.seq)
    causal = torch.tril(torch.ones(run.seq, run.seq, dtype=torch.bool, device=device))
    attention_mask = (~causal).view(1, 1, run.seq, run.seq)
    losses, times, grad_norms = [], [], []
    for tokens, labels in _batches(run, torch):
        tokens, labels = tokens.to(device), labels.to(device)
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if has_ddp:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position_ids, attention_mask, labels=labels).float().mean()
        # fp16 (the example script's precision): the optimizer's dynamic loss scale, as
        # upstream's schedule applies it before backward.
        (optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss).backward()
        if has_ddp and hasattr(model, "finish_grad_sync"):
            model.finish_grad_sync()
        if not megatron_optimizer:
            # A torch optimizer gives no norm: the gradients' L2 norm, as upstream's clipping takes it.
            norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in model.parameters()
                                                         if p.grad is not None]))
        result = optimizer.step()
        if megatron_optimizer:
            norm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        grad_norms.append(None if norm is None else float(norm))
        value = loss.item()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(value)
    return losses, times, grad_norms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaport.train.harness", description=__doc__.split("\n\n")[0])
    defaults = HarnessRun(tree="")
    parser.add_argument("--tree", required=True)
    parser.add_argument("--mode", choices=MODES, default=defaults.mode)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device)
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab", "steps", "warmup", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=defaults.dtype)
    parser.add_argument("--position-embedding", choices=("learned_absolute", "rope"),
                        default=defaults.position_embedding)
    args = vars(parser.parse_args(argv))
    args["position_embedding"] = args.pop("position_embedding")
    try:
        document = train(HarnessRun(**args))
    except BaseException as exc:
        failure.record(exc)  # what it died of, for the baseline's choice of shims
        raise
    sys.stdout.write("\n" + json.dumps(document) + "\n")
    sys.stdout.flush()
    return 0
