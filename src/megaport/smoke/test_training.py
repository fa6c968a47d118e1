"""Training smoke: a few steps of a tiny GPT from the tree with mock data; the loss must fall.

megatron.core's GPTModel with the local (non-TransformerEngine) layer spec, TP=1, a one-rank
process group (the tree's backend on GPUs, gloo on CPU), bf16 so that attention goes through the
fused softmax path, i.e. the port's replacement. Mock data: a fixed batch of random tokens whose
next-token labels the model must learn.

On CPU two pieces of upstream's GPU plumbing cannot run as written (both allocate or seed on
'cuda' by design); the test substitutes exactly these, says so in the report, and leaves every
computation to the tree:
- parallel_state's GlobalMemoryBuffer allocates its scratch tensors on CPU;
- the CUDA RNG tracker's fork() is a no-op (dropout is 0, so no random numbers are drawn in it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import pytest

from megaport.smoke import _tree

STEPS = 8


def tree_import(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            pytest.skip(f"this era has no {name}: it cannot build a GPTModel from megatron.core")
        _tree.skip_or_fail_missing(exc, name)


@contextlib.contextmanager
def cpu_plumbing(parallel_state, tensor_parallel, torch):
    """The two CPU substitutions described in the module docstring, undone afterwards."""
    buffer = parallel_state.get_global_memory_buffer()
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def get_tensor(tensor_shape, dtype, name, *args, **kwargs):
        numel = 1
        for d in tensor_shape:
            numel *= int(d)
        held = buffer.buffer.get((name, dtype))
        if held is None or held.numel() < numel:
            held = buffer.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return held[:numel].view(*tensor_shape)

    buffer.get_tensor = get_tensor
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del buffer.get_tensor
        del tracker.fork


def test_tiny_gpt_loss_falls(smoke, device, process_group, torch_module):
    torch = torch_module
    parallel_state = process_group
    tensor_parallel = tree_import("megatron.core.tensor_parallel")
    config_mod = tree_import("megatron.core.transformer.transformer_config")
    gpt_mod = tree_import("megatron.core.models.gpt.gpt_model")
    specs = tree_import("megatron.core.models.gpt.gpt_layer_specs")
    local_spec = getattr(specs, "get_gpt_layer_local_spec", None)
    if local_spec is None:
        pytest.skip("this era has no get_gpt_layer_local_spec (GPTModel needs TransformerEngine here)")

    dtype = torch.bfloat16
    seq, batch, heads, hidden, vocab = 32, 4, 4, 64, 128
    wanted = dict(
        num_layers=2, hidden_size=hidden, num_attention_heads=heads, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=dtype, pipeline_dtype=dtype,
        masked_softmax_fusion=True, bias_dropout_fusion=False, apply_rope_fusion=False,
    )
    known = {f.name for f in dataclasses.fields(config_mod.TransformerConfig)}
    config = config_mod.TransformerConfig(**{k: v for k, v in wanted.items() if k in known})
    if smoke.gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    model = gpt_mod.GPTModel(config=config, transformer_layer_spec=local_spec(), vocab_size=vocab,
                             max_sequence_length=seq).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq).to(device)
    attention_mask = ~torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    shims = contextlib.nullcontext() if smoke.gpu else cpu_plumbing(parallel_state, tensor_parallel, torch)
    if not smoke.gpu:
        smoke.facts["training_cpu_substitutions"] = [
            "parallel_state GlobalMemoryBuffer on CPU", "CUDA RNG tracker fork() no-op (dropout 0)"]
    losses = []
    softmax_calls = []
    fused = importlib.import_module(_tree.FUSED_SOFTMAX_MODULES[0])
    original = fused.FusedScaleMaskSoftmax.forward_fused_softmax

    def counting(self, *args, **kwargs):
        softmax_calls.append(1)
        return original(self, *args, **kwargs)

    fused.FusedScaleMaskSoftmax.forward_fused_softmax = counting
    try:
        with shims:
            for _ in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                try:
                    loss = model(tokens, position_ids, attention_mask, labels=labels)
                except (AssertionError, RuntimeError) as exc:
                    reason = _tree.cuda_only_reason(exc, smoke.tree)
                    if reason and not smoke.gpu:
                        pytest.skip(reason)
                    raise
                loss = loss.float().mean()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    finally:
        fused.FusedScaleMaskSoftmax.forward_fused_softmax = original
    smoke.facts["training_losses"] = [round(v, 4) for v in losses]
    assert all(v == v for v in losses), f"loss became NaN: {losses}"
    assert softmax_calls, "attention never took FusedScaleMaskSoftmax's fused path (the port's softmax)"
    assert losses[-1] < 0.8 * losses[0], f"loss did not fall over {STEPS} steps: {[round(v, 3) for v in losses]}"
