"""Upstream's own bugs in a window, fixed by the port's after-import steps and, written apart, by a
baseline shim: each checked against real torch.distributed on gloo ranks, with and without the fix."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import pickle
import socket

import pytest
import torch

from megaport.train import failure
from megaport.train.shims import registry
from tests.support import port as port_support

WORLD = 2

#: The shape of upstream 9208adbdc7 … e43abe7dfa's expert groups, at CP2, TP1, EP1 on two ranks.
PARALLEL_STATE = '''
import pytest
import torch


def initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=2, world_size=2):
    rank, groups = torch.distributed.get_rank(), []
    for start in range(world_size):
        end = start + tensor_model_parallel_size
        for k in range(tensor_model_parallel_size * context_parallel_size):
            ranks = range(start + k, end, tensor_model_parallel_size * context_parallel_size)
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                groups.append(group)
    return groups
'''


def _load_parallel_state(folder: str):
    spec = importlib.util.spec_from_file_location("parallel_state_under_test", os.path.join(folder, "parallel_state.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, port: int, out_dir: str, fix: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    if fix == "shim":
        registry.REGISTRY["empty-rank-groups"].install()
    module = _load_parallel_state(out_dir)
    if fix == "port":
        for step in port_support.load().after_import_steps("megatron.core.parallel_state"):
            step(module)
    out = {}
    try:
        groups = module.initialize_model_parallel()
        out["groups"] = [torch.distributed.get_process_group_ranks(g) for g in groups]
        outside = torch.distributed.GroupMember.NON_GROUP_MEMBER
        out["empty_after"] = torch.distributed.new_group([]) is outside if fix == "shim" else None
    except TypeError as exc:
        with open(os.path.join(out_dir, f"{rank}.failure"), "wb") as handle:
            pickle.dump(failure.from_exception(exc), handle)
        out["error"] = str(exc).splitlines()[0]
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(out, handle)
    if "error" not in out:  # rank 0 holds the store: the other rank leaves first
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    os._exit(0)  # a refused group build leaves torch's store half-used: leave without its teardown


def _outcomes(tmp_path, fix: str) -> list:
    (tmp_path / "parallel_state.py").write_text(PARALLEL_STATE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, str(tmp_path), fix), nprocs=WORLD)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]


def test_the_window_fails_unfixed_on_todays_torch_and_the_shim_answers_that_failure(tmp_path):
    outcomes = _outcomes(tmp_path, "none")
    assert all("incompatible constructor arguments" in o.get("error", "") for o in outcomes), outcomes
    found = pickle.loads((tmp_path / "0.failure").read_bytes())
    assert registry.pick([found], []) == "empty-rank-groups"
    assert registry.pick([found], ["empty-rank-groups"]) is None


def test_the_port_gives_each_rank_its_own_group_as_upstreams_fix_does(tmp_path):
    assert [o.get("groups") for o in _outcomes(tmp_path, "port")] == [[[0]], [[1]]]


def test_the_shim_written_apart_gives_the_same_groups(tmp_path):
    outcomes = _outcomes(tmp_path, "shim")
    assert [o.get("groups") for o in outcomes] == [[[0]], [[1]]]
    assert [o["empty_after"] for o in outcomes] == [True, True]


class _OverlappedGather:
    """upstream 2024-04's DistributedOptimizer as far as its forward pre-hook goes: the weights other
    ranks updated are gathered by the hook (``disable_pre_hook`` forces it), ``gathered`` says whether
    the model holds them."""

    def __init__(self, events: list):
        self.remove_pre_hook_handle, self.gathered, self.events = object(), False, events

    def disable_pre_hook(self):
        assert self.remove_pre_hook_handle is not None
        self.remove_pre_hook_handle, self.gathered = None, True
        self.events.append("gathered")

    def enable_pre_hook(self):
        assert self.remove_pre_hook_handle is None
        self.remove_pre_hook_handle = object()
        self.events.append("hook back")


def _checkpointing(events: list):
    import types

    module = types.ModuleType("megatron.training.checkpointing")

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *rest):
        for one in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            events.append(f"saved {'gathered' if one.gathered else 'stale'} weights at {iteration}")

    module.save_checkpoint = save_checkpoint
    for step in port_support.load().after_import_steps("megatron.training.checkpointing"):
        step(module)
    return module


def test_a_save_with_the_gather_pending_gathers_first_and_puts_the_hook_back():
    events = []
    optimizer = _OverlappedGather(events)
    _checkpointing(events).save_checkpoint(15, None, optimizer, None, 0)
    assert events == ["gathered", "saved gathered weights at 15", "hook back"]
    assert optimizer.remove_pre_hook_handle is not None


def test_each_optimizer_of_a_chained_one_is_gathered_before_the_save():
    events = []
    chained = type("Chained", (), {})()
    chained.chained_optimizers = [_OverlappedGather(events), _OverlappedGather(events)]
    _checkpointing(events).save_checkpoint(3, None, chained, None)
    assert events == ["gathered", "gathered", "saved gathered weights at 3", "saved gathered weights at 3",
                      "hook back", "hook back"]


def test_where_upstream_gathered_already_the_save_is_upstreams_alone():
    events = []
    optimizer = _OverlappedGather(events)
    optimizer.disable_pre_hook()  # upstream's own save_checkpoint_and_time, from ac08742c96 on
    events.clear()
    _checkpointing(events).save_checkpoint(15, None, optimizer, None)
    assert events == ["saved gathered weights at 15"] and optimizer.remove_pre_hook_handle is None


def test_the_legacy_norm_reads_a_removed_flag_as_off_for_the_call_alone():
    """core 0.16.1's legacy get_norm reads --apply-layernorm-1p, which its parser no longer has."""
    import argparse
    import types

    namespace = argparse.Namespace(normalization="RMSNorm")
    module = types.ModuleType("megatron.legacy.model.utils")
    module.get_args = lambda: namespace

    def get_norm(config):
        if get_norm.args().apply_layernorm_1p:  # upstream's line, unguarded
            raise NotImplementedError
        return ("RMSNorm", config)

    get_norm.args = module.get_args
    module.get_norm = get_norm
    for step in port_support.load().after_import_steps("megatron.legacy.model.utils"):
        step(module)
    assert module.get_norm("config") == ("RMSNorm", "config")
    assert "apply_layernorm_1p" not in vars(namespace)  # the namespace is left as it was
    namespace.apply_layernorm_1p = True  # where the parser has it, upstream's own reading holds
    try:
        module.get_norm("config")
    except NotImplementedError:
        pass
    else:
        raise AssertionError("the flag the parser gave was not read")


#: upstream 2024-01-17 … 05-30's optimizers, as far as clipping goes: each sub-optimizer of the chain
#: puts its main gradients in place, clips them by its own norm over its model-parallel group (here
#: the rank alone) and steps; the chain reports the root of their squares.
CHAINED = '''
import math

import pytest
import torch

MODEL_PARALLEL = {}


class FP32Optimizer:
    def __init__(self, params, expert):
        self.optimizer = torch.optim.SGD(params, lr=1.0)
        self.optimizer.param_groups[0]["is_expert_parallel"] = expert

    def get_parameters(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_main_grads_for_grad_norm(self):
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def get_model_parallel_group(self):
        return MODEL_PARALLEL["group"]

    def clip_grad_norm(self, clip_grad):
        square = torch.tensor([sum(float(g.pow(2).sum()) for g in self.get_main_grads_for_grad_norm())])
        torch.distributed.all_reduce(square, group=self.get_model_parallel_group())
        norm = float(square.sqrt())
        if clip_grad / (norm + 1.0e-6) < 1.0:
            for p in self.get_parameters():
                p.grad.mul_(clip_grad / (norm + 1.0e-6))
        return norm

    @torch.no_grad()
    def step(self):
        for p in self.get_parameters():
            p.grad = p.main_grad
        norm = self.clip_grad_norm(1.0)
        self.optimizer.step()
        return True, norm, None


class ChainedOptimizer:
    def __init__(self, chained_optimizers):
        self.chained_optimizers = chained_optimizers

    def step(self):
        update_successful, grad_norms = True, []
        for optimizer in self.chained_optimizers:
            ok, norm, _ = optimizer.step()
            update_successful &= ok
            grad_norms.append(norm or 0.0)
        return update_successful, math.sqrt(sum(x ** 2 for x in grad_norms)), 0
'''

#: the dense weights' gradient (alike on both ranks, as after the data-parallel reduction) and each
#: expert-parallel rank's own expert's: norms 5, 2 and sqrt(5), together sqrt(34)
DENSE, EXPERTS = [3.0, 4.0], ([0.0, 2.0], [2.0, 1.0])


def _chain_rank(rank: int, port: int, out_dir: str, fix: str, groups: str = "expert") -> None:
    import sys
    import types

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    alone = [torch.distributed.new_group([r]) for r in range(WORLD)][rank]
    state = types.ModuleType("megatron.core.parallel_state")
    if groups == "expert":
        state.get_expert_model_parallel_group = lambda: torch.distributed.group.WORLD
    else:  # core 0.5: tensor x expert ranks and the pipeline's, no expert group alone
        state.get_tensor_and_expert_parallel_group = lambda: torch.distributed.group.WORLD
        state.get_pipeline_model_parallel_group = lambda: alone
    sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.core": types.ModuleType("megatron.core"),
                        "megatron.core.parallel_state": state})
    sys.modules["megatron.core"].parallel_state = state
    if fix == "shim":
        registry.REGISTRY["chained-clip-total-norm"].install()
    spec = importlib.util.spec_from_file_location("megatron.core.optimizer.optimizer",
                                                  os.path.join(out_dir, "optimizer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if fix == "port":
        for step in port_support.load().after_import_steps("megatron.core.optimizer.optimizer"):
            step(module)
    elif fix == "shim":
        registry.REGISTRY["chained-clip-total-norm"].one_norm_for_the_chain(module)
    module.MODEL_PARALLEL["group"] = alone
    dense, expert = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    dense.main_grad, expert.main_grad = torch.tensor(DENSE), torch.tensor(EXPERTS[rank])
    chain = module.ChainedOptimizer([module.FP32Optimizer([dense], False), module.FP32Optimizer([expert], True)])
    ok, norm, _ = chain.step()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump({"norm": norm, "dense": dense.tolist(), "expert": expert.tolist()}, handle)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _chain_outcomes(tmp_path, fix: str, groups: str = "expert") -> list:
    (tmp_path / "optimizer.py").write_text(CHAINED)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_chain_rank, args=(port, str(tmp_path), fix, groups), nprocs=WORLD)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]


def _clipped(grad, norm):
    return [-g / (norm + 1.0e-6) for g in grad]


def test_unfixed_each_chained_optimizer_clips_by_its_own_norm_and_the_ranks_disagree(tmp_path):
    outcomes = _chain_outcomes(tmp_path, "none")
    assert [round(o["norm"] ** 2, 4) for o in outcomes] == [29.0, 30.0]  # the other rank's expert left out
    assert outcomes[0]["dense"] == pytest.approx(_clipped(DENSE, 5.0))
    assert outcomes[1]["expert"] == pytest.approx(_clipped(EXPERTS[1], 5 ** 0.5))


@pytest.mark.parametrize("groups", ["expert", "tensor-and-expert"])
@pytest.mark.parametrize("fix", ["port", "shim"])
def test_every_chained_optimizer_clips_by_the_norm_of_all_gradients_on_every_rank(tmp_path, fix, groups):
    outcomes = _chain_outcomes(tmp_path, fix, groups)
    total = 34 ** 0.5
    assert [o["norm"] for o in outcomes] == pytest.approx([total, total])
    assert outcomes[0]["dense"] == outcomes[1]["dense"] == pytest.approx(_clipped(DENSE, total))
    for rank, outcome in enumerate(outcomes):
        assert outcome["expert"] == pytest.approx(_clipped(EXPERTS[rank], total))


def test_where_the_chain_prepares_its_gradients_first_the_port_leaves_it_alone():
    import types

    module = types.ModuleType("megatron.core.optimizer.optimizer")

    class ChainedOptimizer:
        def prepare_grads(self):
            return False

        def step(self):
            return True, 1.0, 0

    module.ChainedOptimizer = ChainedOptimizer
    for step in port_support.load().after_import_steps("megatron.core.optimizer.optimizer"):
        step(module)
    assert module.ChainedOptimizer.step is ChainedOptimizer.__dict__["step"]
    assert registry.applies("chained-clip-total-norm", "/nonexistent") is False


#: upstream 2025-10-29 … 2026-02-09's T5 sample, as far as its spans and pads go
T5_DATASET = '''
import numpy


class T5MaskedWordPieceDataset:
    def __init__(self, spans, pad=7):
        self.spans, self._pad_token_id = spans, pad

    def __getitem__(self, idx):
        decoder_output = []
        for indices, labels in self.spans:
            decoder_output.extend(labels)
        decoder_output = numpy.array(decoder_output + [self._pad_token_id], dtype=numpy.int64)
        labels[labels == self._pad_token_id] = 0
        return {"labels": decoder_output}
'''


def _upstream_module(path, name: str, source: str):
    """``source`` written at ``path`` and loaded as upstream's module ``name`` (its file on disk:
    the port and the shims read it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ported(module):
    """``module`` after every step the port runs once it has loaded."""
    for step in port_support.load().after_import_steps(module.__name__):
        step(module)
    return module


def _t5_module(tmp_path, source=T5_DATASET):
    return _upstream_module(tmp_path / "t5_dataset.py", "megatron.core.datasets.t5_dataset", source)


def _fixed_by(module, fix: str, shim: str, function: str):
    """``module`` fixed by the port's after-import steps (``fix`` "port") or by baseline shim ``shim``'s ``function``."""
    if fix == "port":
        return _ported(module)
    getattr(registry.REGISTRY[shim], function)(module)
    return module


def test_unfixed_a_t5_sample_without_masked_spans_fails_and_the_shim_answers_it(tmp_path):
    module = _t5_module(tmp_path)
    with pytest.raises(UnboundLocalError, match="labels") as raised:
        module.T5MaskedWordPieceDataset([])[0]
    assert registry.pick([failure.from_exception(raised.value)], []) == "t5-decoder-output-pads"
    assert module.T5MaskedWordPieceDataset([([1], [3, 7])])[0]["labels"].tolist() == [3, 7, 7]  # pads kept


def test_the_shim_answers_the_failure_a_dataloader_worker_re_raises(tmp_path):
    """With DataLoader workers the main process raises ``UnboundLocalError("Caught UnboundLocalError in
    DataLoader worker process 1.\nOriginal Traceback ...")``: the worker's frames are text."""
    module = _t5_module(tmp_path)
    with pytest.raises(UnboundLocalError) as raised:
        module.T5MaskedWordPieceDataset([])[0]
    import traceback

    worker = "".join(traceback.format_exception(raised.value))
    reraised = UnboundLocalError(f"Caught UnboundLocalError in DataLoader worker process 1.\nOriginal {worker}")
    assert registry.pick([failure.from_exception(reraised)], []) == "t5-decoder-output-pads"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_t5_zeroes_its_decoder_outputs_pads_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_t5_module(tmp_path), fix, "t5-decoder-output-pads", "decoder_output_pads")
    assert module.T5MaskedWordPieceDataset([])[0]["labels"].tolist() == [0]
    assert module.T5MaskedWordPieceDataset([([1], [3, 7])])[0]["labels"].tolist() == [3, 0, 0]


def test_where_the_window_s_statement_is_absent_the_port_leaves_t5_alone(tmp_path):
    module = _t5_module(tmp_path, T5_DATASET.replace("labels[labels ==", "decoder_output[decoder_output =="))
    method = module.T5MaskedWordPieceDataset.__getitem__
    assert _ported(module).T5MaskedWordPieceDataset.__getitem__ is method
    assert registry.applies("t5-decoder-output-pads", str(tmp_path)) is False


#: The shape of upstream 60d5b383fa … 37cd8f280d's GPT specs without TransformerEngine: the TE names
#: were never imported, and the local spec's MoE asked for them.
GPT_LAYER_SPECS = '''
from typing import Optional


class ColumnParallelLinear: ...


class RowParallelLinear: ...


try:
    from transformer_engine_is_not_installed import TEColumnParallelGroupedLinear, TEColumnParallelLinear
    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def get_gpt_layer_local_spec(num_experts: Optional[int] = None):
    return _get_mlp_module_spec(use_te=False, num_experts=num_experts)


def _get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
):
    """Helper function to get module spec for MLP"""
    if num_experts is not None:
        moe_spec = _get_moe_module_spec(
            use_te=True, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, fp8=fp8
        )
        return moe_spec
    return {"linear_fc1": ColumnParallelLinear}


def _get_moe_module_spec(use_te=True, num_experts=None, moe_grouped_gemm=False, fp8=None):
    use_te_grouped_gemm = use_te and TEColumnParallelGroupedLinear is not None
    return {"experts": ColumnParallelLinear, "shared_experts": TEColumnParallelLinear if use_te else ColumnParallelLinear}
'''
GPT_SPECS = "megatron.core.models.gpt.gpt_layer_specs"


def _gpt_specs(tmp_path, source=GPT_LAYER_SPECS):
    return _upstream_module(tmp_path / "megatron/core/models/gpt/gpt_layer_specs.py", GPT_SPECS, source)


def test_unfixed_the_local_moe_spec_asks_for_te_and_the_shim_answers_it(tmp_path):
    module = _gpt_specs(tmp_path)
    assert module.get_gpt_layer_local_spec()["linear_fc1"] is module.ColumnParallelLinear  # dense: fine
    with pytest.raises(NameError, match="TEColumnParallelGroupedLinear") as raised:
        module.get_gpt_layer_local_spec(num_experts=8)
    assert registry.pick([failure.from_exception(raised.value)], []) == "moe-spec-use-te"
    assert registry.applies("moe-spec-use-te", str(tmp_path)) is True


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_the_local_moe_spec_is_built_of_local_layers_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_gpt_specs(tmp_path), fix, "moe-spec-use-te", "moe_spec_takes_use_te")
    assert module.get_gpt_layer_local_spec(num_experts=8) == {"experts": module.ColumnParallelLinear,
                                                              "shared_experts": module.ColumnParallelLinear}


def test_where_the_window_s_call_is_absent_the_port_leaves_the_specs_alone(tmp_path):
    module = _gpt_specs(tmp_path, GPT_LAYER_SPECS.replace("            use_te=True,", "            use_te=use_te,"))
    function = module._get_mlp_module_spec
    assert _ported(module)._get_mlp_module_spec is function
    assert registry.applies("moe-spec-use-te", str(tmp_path)) is False


#: The shape of upstream e801b2bb2f … 3479e6fb26 (2023-09-07 … 12-05): with gradient-accumulation
#: fusion the linear layer's backward hands autograd a placeholder, and the data-parallel hook drops
#: what was added to it, the tied embedding's gradient included.
TIED_WEIGHTS = '''
import torch


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(input, weight)
        return input.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        weight.main_grad.add_(grad_output.t().matmul(input))
        if hasattr(weight, 'grad_added_to_main_grad'):
            grad_weight = torch.empty(weight.main_grad.shape, dtype=input.dtype, requires_grad=False)
            weight.grad_added_to_main_grad = True
        else:
            grad_weight = None
        return grad_output.matmul(weight), grad_weight


class DistributedDataParallel:
    def _make_param_hook(self, param):
        def param_hook(*unused):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
            param.grad = None

        return param_hook


class LanguageModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.share_embeddings_and_output_weights, self.pre_process, self.post_process = True, True, True
        self.embedding = torch.nn.Embedding(5, 3)

    def shared_embedding_or_output_weight(self):
        return self.embedding.weight

    def initialize_last_stage_with_word_embeddings(self):
        if not self.share_embeddings_and_output_weights or (self.pre_process and self.post_process):
            return
'''


def _tied_model_grad(module):
    """The main_grad of an embedding whose weight is also the output layer's, after one backward."""
    model = module.LanguageModule()
    model.initialize_last_stage_with_word_embeddings()
    weight = model.shared_embedding_or_output_weight()
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros_like(weight), False
    grad_acc = weight.expand_as(weight).grad_fn.next_functions[0][0]  # kept, as upstream keeps it: its hook lives
    grad_acc.register_hook(module.DistributedDataParallel()._make_param_hook(weight))
    logits = module.LinearWithGradAccumulationAndAsyncCommunication.apply(model.embedding(torch.tensor([1, 2])),
                                                                          weight)
    logits.square().sum().backward()
    return weight.main_grad


#: 23.04's and 23.06's backward: a continuation line indented with tabs, which dedent leaves alone
TIED_WEIGHTS_TABBED = TIED_WEIGHTS.replace(
    "torch.empty(weight.main_grad.shape, dtype=input.dtype,", "torch.empty(weight.main_grad.shape,\n\t\t\t\t       dtype=input.dtype,")


@pytest.mark.parametrize("source", [TIED_WEIGHTS, TIED_WEIGHTS_TABBED], ids=["spaces", "tabbed-continuation"])
def test_tied_weights_keep_both_layers_gradients_as_upstreams_fix_does(tmp_path, source):
    unfixed = _upstream_module(tmp_path / "unfixed.py", "megatron.tied_unfixed", source)
    torch.manual_seed(0)
    lost = _tied_model_grad(unfixed)
    torch.manual_seed(0)
    model = unfixed.LanguageModule()
    (model.embedding(torch.tensor([1, 2])).matmul(model.embedding.weight.t())).square().sum().backward()
    whole = model.embedding.weight.grad
    assert not torch.allclose(lost, whole)  # the embedding's own gradient was dropped
    fixed = _upstream_module(tmp_path / "fixed.py", "megatron.tied_fixed", source)
    steps = port_support.load().upstream_fixes
    steps._tied_wgrad_placeholder_zeroed(fixed)
    steps._tied_weights_grad_hook(fixed)
    steps._tied_weights_keep_both_gradients(fixed)
    torch.manual_seed(0)
    assert torch.allclose(_tied_model_grad(fixed), whole)


#: The shape of upstream v2.0 … 7db9c1e55c (2021-01-12 … 01-25): mpu/layers.py's CPU initialization
#: calls a rank function mpu had renamed.
MPU_LAYERS_CPU_INIT = '''
def get_tensor_model_parallel_rank():
    return 1


def get_tensor_model_parallel_world_size():
    return 2


def _initialize_affine_weight_cpu(rows):
    rank = get_model_parallel_rank()
    world_size = get_tensor_model_parallel_world_size()
    return rows[rank::world_size]
'''


def _mpu_layers(tmp_path):
    return _upstream_module(tmp_path / "megatron/mpu/layers.py", "megatron.mpu.layers", MPU_LAYERS_CPU_INIT)


def test_unfixed_cpu_initialization_names_a_removed_function_and_the_shim_answers_it(tmp_path):
    module = _mpu_layers(tmp_path)
    with pytest.raises(NameError, match="get_model_parallel_rank") as raised:
        module._initialize_affine_weight_cpu([0, 1, 2, 3])
    assert registry.pick([failure.from_exception(raised.value)], []) == "cpu-init-rank-name"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_cpu_initialization_takes_this_ranks_rows_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_mpu_layers(tmp_path), fix, "cpu-init-rank-name", "rank_named")
    assert module._initialize_affine_weight_cpu([0, 1, 2, 3]) == [1, 3]


#: The shape of upstream 42c4071581 … 1a26b2910d (2022-11-02 … 11-08): the legacy model's layer count
#: calls pipeline functions it no longer imports.
LEGACY_LAYER_COUNT = '''
class mpu:
    @staticmethod
    def get_pipeline_model_parallel_world_size():
        return 2

    @staticmethod
    def get_pipeline_model_parallel_rank():
        return 0

    @staticmethod
    def is_pipeline_stage_before_split():
        return True


def _get_num_layers(num_layers):
    if get_pipeline_model_parallel_world_size() > 1:
        return num_layers // 2 if is_pipeline_stage_before_split() else get_pipeline_model_parallel_rank()
    return num_layers
'''


def _legacy_transformer(tmp_path):
    return _upstream_module(tmp_path / "megatron/model/transformer.py", "megatron.model.transformer", LEGACY_LAYER_COUNT)


def test_unfixed_the_legacy_layer_count_names_functions_it_lost_and_the_shim_answers_it(tmp_path):
    module = _legacy_transformer(tmp_path)
    with pytest.raises(NameError, match="get_pipeline_model_parallel_world_size") as raised:
        module._get_num_layers(4)
    assert registry.pick([failure.from_exception(raised.value)], []) == "layer-count-mpu"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_the_legacy_layer_count_asks_mpu_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_legacy_transformer(tmp_path), fix, "layer-count-mpu", "names_from_mpu")
    assert module._get_num_layers(4) == 2


def test_outside_the_windows_a_module_calling_through_mpu_is_left_alone(tmp_path):
    """After 1a26b2910d the layer count calls ``mpu.`` functions: no bare name to give, nothing bound."""
    fixed = LEGACY_LAYER_COUNT.replace("if get_pipeline", "if mpu.get_pipeline").replace(
        "if is_pipeline", "if mpu.is_pipeline").replace("else get_pipeline", "else mpu.get_pipeline")
    module = _ported(_upstream_module(tmp_path / "megatron/model/transformer.py", "megatron.model.transformer", fixed))
    assert not hasattr(module, "get_pipeline_model_parallel_world_size") and module._get_num_layers(4) == 2


#: The shape of upstream 0bc3547702 … 26c3d085b4's save_checkpoint: a rank's files written, then a
#: debug line naming the rank, which the converter (no process group) could not give.
CHECKPOINT_SAVE_LOGS_RANK = '''
import logging
import os

import torch

logger = logging.getLogger(__name__)


def save_checkpoint(iteration, model, optimizer, save_dir):
    with open(os.path.join(save_dir, f"rank_{iteration}"), "w") as handle:
        handle.write("weights")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(os.path.join(save_dir, "latest"), "w") as handle:
            handle.write(str(iteration))
    logger.debug(f"rank: {torch.distributed.get_rank()}, takes {1.5} to finalize ckpt save ")
    return iteration
'''


def _checkpoint_saver(tmp_path, source=CHECKPOINT_SAVE_LOGS_RANK):
    return _upstream_module(tmp_path / "megatron/training/checkpointing.py", "megatron.training.checkpointing", source)


def test_unfixed_a_save_without_a_process_group_stops_after_the_first_rank(tmp_path):
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="process group"):
        _checkpoint_saver(tmp_path).save_checkpoint(0, None, None, str(tmp_path))


def test_a_save_without_a_process_group_logs_rank_zero_as_upstreams_fix_does(tmp_path, caplog):
    """What upstream's converter does: one save per tensor-parallel rank, no process group."""
    module = _ported(_checkpoint_saver(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="megatron.training.checkpointing"):
        assert [module.save_checkpoint(rank, None, None, str(tmp_path)) for rank in (1, 2)] == [1, 2]
    assert (tmp_path / "rank_1").exists() and (tmp_path / "rank_2").exists()
    assert "rank: 0, takes 1.5 to finalize" in caplog.text
    assert getattr(module.save_checkpoint, "__rocm_port_gathered__", False)  # the gather step still wraps it


def test_a_save_whose_log_names_a_kept_rank_is_left_alone(tmp_path):
    """After 26c3d085b4 the line logs ``{rank}``, computed with the guard: nothing to recompile."""
    fixed = CHECKPOINT_SAVE_LOGS_RANK.replace(
        '    logger.debug(f"rank: {torch.distributed.get_rank()}',
        '    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0\n'
        '    logger.debug(f"rank: {rank}')
    module = _checkpoint_saver(tmp_path, fixed)
    upstream = module.save_checkpoint
    assert inspect.unwrap(_ported(module).save_checkpoint) is upstream


# -- arguments validated twice (main ca87dcd697 … 4d4621ba08, 2024-12-19 … 2025-01-31) ---------------

#: the window's validate_args, as far as the optimizer's dtype flags go
VALIDATE_ARGS = '''
import torch


def validate_args(args, defaults={}):
    dtype_map = {
        'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp8': torch.uint8,
    }
    args.main_grads_dtype = dtype_map[args.main_grads_dtype]
    args.exp_avg_dtype = dtype_map[args.exp_avg_dtype]
    return args
'''
#: upstream's 4d4621ba08: a dtype already mapped stays
VALIDATE_ARGS_FIXED = VALIDATE_ARGS.replace("    args.main_grads_dtype = dtype_map[args.main_grads_dtype]\n", (
    "    map_dtype = lambda d: d if isinstance(d, torch.dtype) else dtype_map[d]\n"
    "    args.main_grads_dtype = map_dtype(args.main_grads_dtype)\n")).replace(
    "dtype_map[args.exp_avg_dtype]", "map_dtype(args.exp_avg_dtype)")


def _arguments(tmp_path, source=VALIDATE_ARGS):
    return _upstream_module(tmp_path / "megatron/training/arguments.py", "megatron.training.arguments", source)


def _run_args():
    import types

    return types.SimpleNamespace(main_grads_dtype="fp32", exp_avg_dtype="bf16", fp8=None)


def test_unfixed_arguments_validated_once_fail_the_second_validation_as_the_converter_met_it(tmp_path):
    module = _arguments(tmp_path)
    args = module.validate_args(_run_args())  # the loader's validation
    with pytest.raises(KeyError, match="torch.float32"):
        module.validate_args(args)  # the saver's, of the loader's arguments


def test_arguments_validate_twice_as_upstreams_fix_has_it(tmp_path):
    module = _ported(_arguments(tmp_path))
    args = module.validate_args(module.validate_args(_run_args()))
    assert (args.main_grads_dtype, args.exp_avg_dtype) == (torch.float32, torch.bfloat16)
    with pytest.raises(KeyError, match="fp64"):  # a name the map lacks is still refused
        module.validate_args(_run_args().__class__(main_grads_dtype="fp64", exp_avg_dtype="fp32", fp8=None))


def test_where_upstream_maps_each_dtype_once_the_port_leaves_validate_args_alone(tmp_path):
    module = _ported(_arguments(tmp_path, VALIDATE_ARGS_FIXED))
    assert not getattr(module.validate_args, "__rocm_port_fixed__", False)
    args = module.validate_args(module.validate_args(_run_args()))
    assert args.main_grads_dtype is torch.float32


# -- language_module's unguarded TE import (main eaf9408232 … 028729b9bc, 2025-03-08 … 03-15) ----------

#: the window's module, as far as its imports go: the extension module imports TE first thing
LANGUAGE_MODULE = '''
import torch

from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy


def cross_entropy(logits, labels):
    if te_parallel_cross_entropy is not None:
        return te_parallel_cross_entropy(logits, labels)
    return torch.nn.functional.cross_entropy(logits, labels)
'''
LANGUAGE_MODULE_NAME = "megatron.core.models.common.language_module.language_module"


def _language_module_tree(tmp_path, source=LANGUAGE_MODULE):
    """A tree with the window's language module and an extension module that imports TE unguarded."""
    (tmp_path / "megatron/core/extensions").mkdir(parents=True)
    (tmp_path / "megatron/core/extensions/transformer_engine.py").write_text(
        "import transformer_engine as te  # noqa: F401\n\ndef te_parallel_cross_entropy(*args):\n    raise RuntimeError\n")
    path = tmp_path / "megatron/core/models/common/language_module/language_module.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    return path


@pytest.fixture
def own_megatron_modules(monkeypatch):
    """The test's ``megatron`` packages (from its tree) leave ``sys.modules`` with it: the next test's
    imports find theirs."""
    import sys

    before = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "megatron"}
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [name for name in sys.modules if name.split(".")[0] == "megatron"]:
        del sys.modules[name]
    sys.modules.update(before)


def _load_language_module(tmp_path, monkeypatch, run):
    """The tree's language module loaded as upstream's (its package from the tree) and run by ``run``."""
    import types

    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "megatron/core/models/common/language_module/language_module.py"
    module = types.ModuleType(LANGUAGE_MODULE_NAME)
    module.__file__ = str(path)
    run(module, path.read_text(), str(path))
    return module


def _as_it_is(module, source, filename):
    exec(compile(source, filename, "exec"), module.__dict__)


def _by_the_port(module, source, filename):
    code = port_support.load().upstream_fixes._fixed_module_code(LANGUAGE_MODULE_NAME, source, filename)
    assert code is not None
    exec(code, module.__dict__)


def _by_the_shim(module, source, filename):
    shim = registry.REGISTRY["te-cross-entropy-import"]
    exec(compile(shim.guarded_import(source), filename, "exec"), module.__dict__)


def test_unfixed_the_language_module_needs_te_and_the_shim_answers_that_failure(tmp_path, monkeypatch,
                                                                              own_megatron_modules):
    _language_module_tree(tmp_path)
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here: the window's import succeeds")
    with pytest.raises(ModuleNotFoundError, match="transformer_engine") as raised:
        _load_language_module(tmp_path, monkeypatch, _as_it_is)
    assert registry.pick([failure.from_exception(raised.value)], []) == "te-cross-entropy-import"
    assert registry.applies("te-cross-entropy-import", str(tmp_path)) is True


@pytest.mark.parametrize("run", [_by_the_port, _by_the_shim], ids=["port", "shim"])
def test_the_language_module_imports_without_te_as_upstreams_fix_does(tmp_path, monkeypatch, run, own_megatron_modules):
    _language_module_tree(tmp_path)
    module = _load_language_module(tmp_path, monkeypatch, run)
    logits, labels = torch.randn(3, 5), torch.tensor([0, 4, 2])
    assert module.te_parallel_cross_entropy is None
    assert torch.equal(module.cross_entropy(logits, labels), torch.nn.functional.cross_entropy(logits, labels))


def test_where_the_import_is_guarded_the_port_and_the_shim_leave_the_module_alone(tmp_path):
    fixed = LANGUAGE_MODULE.replace(
        "from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy\n",
        "try:\n    from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy\n"
        "except:\n    te_parallel_cross_entropy = None\n")
    _language_module_tree(tmp_path, fixed)
    assert port_support.load().upstream_fixes._fixed_module_code(LANGUAGE_MODULE_NAME, fixed, "x.py") is None
    assert registry.REGISTRY["te-cross-entropy-import"].guarded_import(fixed) == fixed
    assert registry.applies("te-cross-entropy-import", str(tmp_path)) is False


# -- Megatron-Bridge's unguarded TE import (the converter upstream's docs name for Llama since 2026-05) ----

#: Bridge 0.6.2's megatron/bridge/peft/lora_layers.py, as far as its import and TE names at definition go
BRIDGE_LORA_LAYERS = '''"""LoRA layers."""
import math

import torch
import transformer_engine.pytorch as te


class TEFusedLoRALinear(torch.nn.Module):
    def _make_fused_branches(self) -> tuple[te.ops.Sequential, te.ops.Sequential]:
        return te.ops.Sequential(), te.ops.Sequential()


class LinearAdapter(torch.nn.Linear):
    scale = math.sqrt(4.0)
'''
BRIDGE_LORA_NAME = "megatron.bridge.peft.lora_layers"


def _bridge_module(source, run):
    import types

    module = types.ModuleType(BRIDGE_LORA_NAME)
    run(module, source)
    return module


def _bridge_by_the_port(module, source):
    code = port_support.load().upstream_fixes._fixed_module_code(BRIDGE_LORA_NAME, source, "lora_layers.py")
    assert code is not None
    exec(code, module.__dict__)


def test_bridge_stops_at_its_te_import_and_the_port_serves_it(tmp_path, monkeypatch):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here: Bridge's import succeeds")
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        _bridge_module(BRIDGE_LORA_LAYERS, lambda m, s: exec(compile(s, "lora_layers.py", "exec"), m.__dict__))
    module = _bridge_module(BRIDGE_LORA_LAYERS, _bridge_by_the_port)
    assert module.te is None and module.__doc__ == "LoRA layers."
    assert module.LinearAdapter(2, 3).scale == 2.0  # the rest of the module is Bridge's, unchanged


def test_where_te_is_installed_bridge_imports_it_through_the_ports_guard(tmp_path, monkeypatch):
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pytorch.py").write_text("class ops:\n    class Sequential:\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = __import__("sys").modules
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.delitem(modules, name, raising=False)
    try:
        module = _bridge_module(BRIDGE_LORA_LAYERS, _bridge_by_the_port)
        assert module.te.__name__ == "transformer_engine.pytorch"
        assert isinstance(module.TEFusedLoRALinear()._make_fused_branches()[0], module.te.ops.Sequential)
    finally:  # the stand-in TE leaves with the test: a later test is told TE is not installed
        for name in ("transformer_engine.pytorch", "transformer_engine"):
            modules.pop(name, None)


def test_where_bridge_guards_its_te_import_the_port_leaves_it_alone():
    guarded = BRIDGE_LORA_LAYERS.replace("import transformer_engine.pytorch as te\n",
                                         "try:\n    import transformer_engine.pytorch as te\nexcept ImportError:\n"
                                         "    te = None\n")
    assert port_support.load().upstream_fixes._fixed_module_code(BRIDGE_LORA_NAME, guarded, "x.py") is None


# -- the nano-v3-vl snapshot's unguarded TE import (megatron.training imports the projector) ---------

#: fa48608a3d's megatron/core/models/vision/multimodal_projector.py, as far as the import and its one use go
PROJECTOR = '''
import torch

from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint


def checkpointed_forward(forward_func, hidden_states):
    use_te = False
    if use_te:
        return te_checkpoint(forward_func, hidden_states)
    return forward_func(hidden_states)
'''
PROJECTOR_NAME = "megatron.core.models.vision.multimodal_projector"


def test_the_snapshot_s_projector_needs_te_and_the_port_imports_it_without(tmp_path):
    import types

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here: the snapshot's import succeeds")
    with pytest.raises(ModuleNotFoundError, match="transformer_engine") as raised:
        exec(compile(PROJECTOR, "multimodal_projector.py", "exec"), {})
    # unported upstream (the parity baseline) is answered by its own shim, written apart, before the TE
    # import stub (with which the FP8 helpers believe TE is there and import its tensor classes)
    assert registry.pick([failure.from_exception(raised.value)], []) == "te-projector-import"
    shim = registry.REGISTRY["te-projector-import"]
    served: dict = {}
    exec(compile(shim.guarded_import(PROJECTOR), "multimodal_projector.py", "exec"), served)
    assert served["te_checkpoint"] is None
    module = types.ModuleType(PROJECTOR_NAME)
    code = port_support.load().upstream_fixes._fixed_module_code(PROJECTOR_NAME, PROJECTOR, "multimodal_projector.py")
    assert code is not None
    exec(code, module.__dict__)
    assert module.te_checkpoint is None
    hidden = torch.randn(2, 3)
    assert torch.equal(module.checkpointed_forward(lambda x: x * 2, hidden), hidden * 2)


def test_where_the_projector_imports_no_te_the_port_leaves_it_alone():
    main_s = PROJECTOR.replace("from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint\n", "")
    assert port_support.load().upstream_fixes._fixed_module_code(PROJECTOR_NAME, main_s, "x.py") is None
    assert registry.REGISTRY["te-projector-import"].guarded_import(main_s) == main_s


#: The shape of upstream 8fba594837 … b5836f82f6 (2025-01-09 … 02-10): the attention base class takes
#: the sequence offset TransformerLayer passes, MultiLatentAttention's forward does not.
MLA_WITHOUT_OFFSET = '''
class Attention:
    def forward(self, hidden_states, attention_mask, inference_params=None, sequence_len_offset=None):
        return hidden_states


class MultiLatentAttention(Attention):
    def forward(self, hidden_states, attention_mask, inference_params=None, packed_seq_params=None,
                position_ids=None):
        return hidden_states * 2


def transformer_layer(attention, hidden_states):
    return attention.forward(hidden_states, None, inference_params=None, sequence_len_offset=None)
'''


def _mla_module(tmp_path, source=MLA_WITHOUT_OFFSET):
    return _upstream_module(tmp_path / "megatron/core/transformer/multi_latent_attention.py",
                            "megatron.core.transformer.multi_latent_attention", source)


def test_unfixed_mla_refuses_the_layers_sequence_offset_and_the_shim_answers_it(tmp_path):
    module = _mla_module(tmp_path)
    with pytest.raises(TypeError, match="sequence_len_offset") as raised:
        module.transformer_layer(module.MultiLatentAttention(), 3)
    assert registry.pick([failure.from_exception(raised.value)], []) == "mla-sequence-len-offset"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_mla_takes_the_sequence_offset_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_mla_module(tmp_path), fix, "mla-sequence-len-offset", "offset_taken")
    assert module.transformer_layer(module.MultiLatentAttention(), 3) == 6


@pytest.mark.parametrize("source", [
    MLA_WITHOUT_OFFSET.replace("position_ids=None):", "position_ids=None, sequence_len_offset=None):"),
    MLA_WITHOUT_OFFSET.replace(", sequence_len_offset=None):\n        return hidden_states\n",
                               "):\n        return hidden_states\n")], ids=["fixed", "before-the-window"])
def test_outside_the_window_the_port_leaves_mlas_forward_alone(tmp_path, source):
    module = _mla_module(tmp_path, source)
    forward = module.MultiLatentAttention.forward
    assert _ported(module).MultiLatentAttention.forward is forward


#: The shape of upstream 2e047cff8a … 60d5b383fa (2024-10-29 … 12-07): the attention base class takes
#: flash decoding's rotary cos/sin, which TransformerLayer passes every attention, MLA's forward does not.
MLA_WITHOUT_COS_SIN = MLA_WITHOUT_OFFSET.replace(
    "sequence_len_offset=None):", "rotary_pos_cos=None, rotary_pos_sin=None):").replace(
    "sequence_len_offset=None)\n", "rotary_pos_cos=None, rotary_pos_sin=None)\n")


def test_unfixed_mla_refuses_the_layers_rotary_cos_sin_and_the_shim_answers_it(tmp_path):
    module = _mla_module(tmp_path, MLA_WITHOUT_COS_SIN)
    with pytest.raises(TypeError, match="rotary_pos_cos") as raised:
        module.transformer_layer(module.MultiLatentAttention(), 3)
    assert registry.pick([failure.from_exception(raised.value)], []) == "mla-rotary-pos-cos-sin"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_mla_takes_the_rotary_cos_sin_and_refuses_a_value_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_mla_module(tmp_path, MLA_WITHOUT_COS_SIN), fix, "mla-rotary-pos-cos-sin", "cos_sin_taken")
    assert module.transformer_layer(module.MultiLatentAttention(), 3) == 6
    with pytest.raises(AssertionError, match="MLA does not support Flash Decoding"):
        module.MultiLatentAttention().forward(3, None, rotary_pos_cos=torch.ones(1), rotary_pos_sin=torch.ones(1))


def test_the_port_wraps_mlas_forward_once(tmp_path):
    module = _ported(_mla_module(tmp_path, MLA_WITHOUT_COS_SIN))
    forward = module.MultiLatentAttention.forward
    port_support.load().upstream_fixes._mla_takes_the_layers_keywords(module)  # a second after-import pass
    assert module.MultiLatentAttention.forward is forward
    assert module.transformer_layer(module.MultiLatentAttention(), 3) == 6


#: The shape of upstream 2e047cff8a … bc8c4f3562 (2024-10-29 … 11-07, e.g. d229a2995d): both MLA windows
#: at once, the layer's rotary cos/sin and the KV-cache update asking for the query MLA does not pass.
MLA_FLASH_DECODING_WINDOW = '''
class Attention:
    def _adjust_key_value_for_inference(self, inference_params, query, key, value, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None):
        if inference_params is None:
            return query, key, value, rotary_pos_emb, "causal"
        return query * 10, key * 10, value * 10, rotary_pos_emb, "no mask"

    def forward(self, hidden_states, attention_mask, inference_params=None, rotary_pos_cos=None,
                rotary_pos_sin=None):
        return hidden_states


class MultiLatentAttention(Attention):
    def forward(self, hidden_states, attention_mask, inference_params=None, packed_seq_params=None,
                position_ids=None):
        query, key, value = hidden_states, hidden_states + 1, hidden_states + 2
        key, value, _, attn_mask_type = self._adjust_key_value_for_inference(
            inference_params, key, value, rotary_pos_emb=None
        )
        return query + key + value


def transformer_layer(attention, hidden_states, inference_params=None):
    return attention.forward(hidden_states, None, inference_params=inference_params, rotary_pos_cos=None,
                             rotary_pos_sin=None)
'''


def test_unfixed_mla_of_the_flash_decoding_window_fails_twice_and_a_shim_answers_each(tmp_path):
    module = _mla_module(tmp_path, MLA_FLASH_DECODING_WINDOW)
    with pytest.raises(TypeError, match="rotary_pos_cos") as raised:
        module.transformer_layer(module.MultiLatentAttention(), 3)
    assert registry.pick([failure.from_exception(raised.value)], []) == "mla-rotary-pos-cos-sin"
    registry.REGISTRY["mla-rotary-pos-cos-sin"].cos_sin_taken(module)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'value'") as raised:
        module.transformer_layer(module.MultiLatentAttention(), 3)
    assert registry.pick([failure.from_exception(raised.value)], ["mla-rotary-pos-cos-sin"]) == "mla-cache-update-query"


@pytest.mark.parametrize("fix", ["port", "shims"])
def test_mla_of_the_flash_decoding_window_trains_as_upstreams_fixes_make_it(tmp_path, fix):
    module = _mla_module(tmp_path, MLA_FLASH_DECODING_WINDOW)
    if fix == "port":
        _ported(module)
    else:
        registry.REGISTRY["mla-rotary-pos-cos-sin"].cos_sin_taken(module)
        registry.REGISTRY["mla-cache-update-query"].old_call_taken(module)
    assert module.transformer_layer(module.MultiLatentAttention(), 3) == 3 + 4 + 5


def test_the_ports_mla_hands_the_cache_update_its_query_as_upstreams_fix(tmp_path):
    """Upstream's 369fec6c7c passes the query and takes back the one the update returns (flash decoding's)."""
    module = _ported(_mla_module(tmp_path, MLA_FLASH_DECODING_WINDOW))
    assert module.transformer_layer(module.MultiLatentAttention(), 3, inference_params=object()) == 30 + 40 + 50


def test_where_mla_passes_its_query_the_port_leaves_the_call_alone(tmp_path):
    fixed = MLA_FLASH_DECODING_WINDOW.replace("key, value, _, attn_mask_type = self._adjust_key_value_for_inference(\n"
                                              "            inference_params, key, value,",
                                              "query, key, value, _, attn_mask_type = self._adjust_key_value_for_inference(\n"
                                              "            inference_params, query, key, value,")
    assert fixed != MLA_FLASH_DECODING_WINDOW
    module = _mla_module(tmp_path, fixed)
    upstreams = module.MultiLatentAttention.forward
    port_support.load().upstream_fixes._mla_hands_its_query_to_the_cache_update(module)
    assert module.MultiLatentAttention.forward is upstreams


#: The shape of upstream 2bdc60c4af … 60d5b383fa (2024-11-15 … 12-07): the layer builds every attention
#: with cp_comm_type, which the base class's constructor takes and MLASelfAttention's does not.
MLA_CP_COMM_TYPE_WINDOW = '''
class Attention:
    def __init__(self, config, layer_number, attn_mask_type=None, attention_type=None, cp_comm_type=None):
        self.config = config

    def forward(self, hidden_states, attention_mask):
        return hidden_states


class MultiLatentAttention(Attention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type):
        super().__init__(config, layer_number, attn_mask_type, attention_type)


class MLASelfAttention(MultiLatentAttention):
    def __init__(self, config, layer_number, attn_mask_type=None):
        super().__init__(config, layer_number, attn_mask_type, "self")


def transformer_layer(attention_class, config):
    return attention_class(config, 1, attn_mask_type="causal", cp_comm_type="p2p")
'''


def test_unfixed_mla_of_the_cp_comm_type_window_builds_nothing_and_the_shim_answers_it(tmp_path):
    module = _mla_module(tmp_path, MLA_CP_COMM_TYPE_WINDOW)
    with pytest.raises(TypeError, match="cp_comm_type") as raised:
        module.transformer_layer(module.MLASelfAttention, "config")
    assert registry.pick([failure.from_exception(raised.value)], []) == "mla-cp-comm-type"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_mla_of_the_cp_comm_type_window_builds_as_upstreams_fix_makes_it(tmp_path, fix):
    module = _fixed_by(_mla_module(tmp_path, MLA_CP_COMM_TYPE_WINDOW), fix, "mla-cp-comm-type", "cp_comm_type_taken")
    attention = module.transformer_layer(module.MLASelfAttention, "config")
    assert isinstance(attention, module.MLASelfAttention) and attention.config == "config"


#: The shape of upstream 044e2ad5aa … e6b3c4921f (2025-02-10 … 03-12): the all-to-all dispatcher keeps
#: the counts it has not viewed per local expert for its sort after the all-to-all.
DISPATCHER_COUNTS = '''
import torch


class MoEAlltoAllTokenDispatcher:
    def __init__(self, num_local_experts, moe_permute_fusion=False):
        self.num_local_experts = num_local_experts
        self.moe_permute_fusion = moe_permute_fusion

    def preprocess(self, counts):
        num_global_tokens_per_local_expert = counts  # [tp_size, ep_size, num_local_experts]
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = num_global_tokens_per_local_expert.view(
                -1, self.num_local_experts
            )
            if not self.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = num_global_tokens_per_local_expert.to(
                    torch.device("cpu"), non_blocking=False
                )
        return counts.sum(dim=(0, 1))
'''


def _dispatcher(tmp_path, source=DISPATCHER_COUNTS):
    return _upstream_module(tmp_path / "megatron/core/transformer/moe/token_dispatcher.py",
                            "megatron.core.transformer.moe.token_dispatcher", source)


def test_the_dispatcher_sorts_by_the_counts_viewed_per_local_expert_as_upstreams_fix_does(tmp_path):
    counts = torch.arange(8).reshape(2, 2, 2)  # TP2 x EP2 x two local experts
    unfixed = _dispatcher(tmp_path).MoEAlltoAllTokenDispatcher(2)
    unfixed.preprocess(counts)
    assert unfixed.num_global_tokens_per_local_expert.shape == (2, 2, 2)  # the window's bug: not [tp*ep, experts]
    ported = _ported(_dispatcher(tmp_path)).MoEAlltoAllTokenDispatcher(2)
    assert torch.equal(ported.preprocess(counts), unfixed.preprocess(counts))
    assert torch.equal(ported.num_global_tokens_per_local_expert, counts.view(-1, 2))


def test_where_the_dispatcher_keeps_its_viewed_counts_the_port_leaves_it_alone(tmp_path):
    fixed = DISPATCHER_COUNTS.replace("= num_global_tokens_per_local_expert.to(",
                                      "= self.num_global_tokens_per_local_expert.to(")
    module = _dispatcher(tmp_path, fixed)
    preprocess = module.MoEAlltoAllTokenDispatcher.preprocess
    assert _ported(module).MoEAlltoAllTokenDispatcher.preprocess is preprocess


# -- main 5f5741db9b: the MoE experts import a decorator from a module upstream never had ------------

DECORATED_NAME = "megatron.core.transformer.moe.experts"
#: 5f5741db9b's experts.py, as far as the import and one use of it go
DECORATED_EXPERTS = '''"""Experts."""
import torch

from megatron.core.backwards_compatibility_decorators import deprecated


class GroupedMLP(torch.nn.Module):
    @deprecated(version="0.16", removal_version="0.18", alternative="TEGroupedMLP")
    def __init__(self):
        super().__init__()
'''
#: megatron/core/utils.py's decorator at that commit (the warning it gives, and the object it returns)
DECORATOR_UTILS = '''import functools, warnings


def deprecated(version, removal_version=None, alternative=None, reason=None):
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            warnings.warn(f"{func.__qualname__} is deprecated since {version}", DeprecationWarning)
            return func(*args, **kwargs)
        return wrapper
    return decorator
'''


def _experts_tree(tmp_path, experts=DECORATED_EXPERTS):
    for package in ("megatron", "megatron/core", "megatron/core/transformer", "megatron/core/transformer/moe"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "megatron/core/utils.py").write_text(DECORATOR_UTILS)
    (tmp_path / "megatron/core/transformer/moe/experts.py").write_text(experts)


def _load_experts(tmp_path, monkeypatch, source_of):
    import types

    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "megatron/core/transformer/moe/experts.py"
    module = types.ModuleType(DECORATED_NAME)
    module.__file__ = str(path)
    exec(source_of(path.read_text(), str(path)), module.__dict__)
    return module


def test_unfixed_the_experts_stop_every_import_and_the_shim_answers_that_failure(tmp_path, monkeypatch,
                                                                             own_megatron_modules):
    _experts_tree(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="backwards_compatibility_decorators") as raised:
        _load_experts(tmp_path, monkeypatch, lambda source, name: compile(source, name, "exec"))
    assert registry.pick([failure.from_exception(raised.value)], []) == "deprecated-decorator-import"
    assert registry.applies("deprecated-decorator-import", str(tmp_path)) is True


def _by_the_port_fix(source, filename):
    code = port_support.load().upstream_fixes._fixed_module_code(DECORATED_NAME, source, filename)
    assert code is not None
    return code


def _by_the_decorator_shim(source, filename):
    return compile(registry.REGISTRY["deprecated-decorator-import"].moved_import(source), filename, "exec")


@pytest.mark.parametrize("source_of", [_by_the_port_fix, _by_the_decorator_shim], ids=["port", "shim"])
def test_the_experts_import_the_decorator_from_where_upstreams_fix_does(tmp_path, monkeypatch, source_of,
                                                                       own_megatron_modules):
    _experts_tree(tmp_path)
    module = _load_experts(tmp_path, monkeypatch, source_of)
    with pytest.warns(DeprecationWarning, match="GroupedMLP.__init__ is deprecated since 0.16"):
        assert isinstance(module.GroupedMLP(), torch.nn.Module)


def test_where_the_decorator_comes_from_utils_the_port_and_the_shim_leave_the_experts_alone(tmp_path):
    fixed = DECORATED_EXPERTS.replace("megatron.core.backwards_compatibility_decorators", "megatron.core.utils")
    _experts_tree(tmp_path, fixed)
    assert port_support.load().upstream_fixes._fixed_module_code(DECORATED_NAME, fixed, "x.py") is None
    assert registry.REGISTRY["deprecated-decorator-import"].moved_import(fixed) == fixed
    assert registry.applies("deprecated-decorator-import", str(tmp_path)) is False


#: core's TransformerConfig from 3316e811cc until 8b9a2510f5 (the fork's until d9fa3022), as far as
#: its recomputation checks go; its base class's __post_init__ is called through super()
TRANSFORMER_CONFIG = '''
from dataclasses import dataclass


@dataclass
class ModelParallelConfig:
    sequence_parallel_enabled: bool = False

    def __post_init__(self):
        pass


@dataclass
class TransformerConfig(ModelParallelConfig):
    recompute_granularity: str = None
    recompute_method: str = None
    recompute_num_layers: int = None

    def __post_init__(self):
        super().__post_init__()
        if self.recompute_granularity is not None:
            if not self.recompute_granularity in ['full', 'selective']:
                raise ValueError(f'When using recompute_granuarlity: {self.recompute_granularity} must be "full" or "selective".')

            if self.recompute_method is not None:
                if not self.recompute_method in ['block', 'uniform']:
                    raise ValueError(f'recompute_method: {self.recompute_method} must be "block" or "uniform".')
            else:
                raise ValueError(
                    f'Using recompute_granularity: {self.recompute_granularity} so recompute_method must be "block" or "uniform"'
                )

            if self.recompute_num_layers is None:
                raise ValueError(f'When using recompute_granularity: {self.recompute_granularity} so recompute_num_layers must be set')
'''


def _transformer_config(tmp_path, source=TRANSFORMER_CONFIG):
    return _upstream_module(tmp_path / "megatron/core/transformer/transformer_config.py",
                            "megatron.core.transformer.transformer_config", source)


def test_unfixed_selective_recomputation_asks_for_a_method_and_the_shim_answers_it(tmp_path):
    with pytest.raises(ValueError, match="so recompute_method must be") as raised:
        _transformer_config(tmp_path).TransformerConfig(recompute_granularity="selective", recompute_num_layers=1)
    assert registry.pick([failure.from_exception(raised.value)], []) == "selective-recompute-method"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_selective_recomputation_takes_no_method_as_upstreams_fix_does(tmp_path, fix):
    module = _fixed_by(_transformer_config(tmp_path), fix, "selective-recompute-method", "selective_without_method")
    config = module.TransformerConfig(recompute_granularity="selective", recompute_num_layers=1)
    assert (config.recompute_granularity, config.recompute_method) == ("selective", None)
    with pytest.raises(ValueError, match="so recompute_method must be"):  # full recomputation still needs one
        module.TransformerConfig(recompute_granularity="full", recompute_num_layers=1)
    with pytest.raises(ValueError, match="must be \"full\" or \"selective\""):
        module.TransformerConfig(recompute_granularity="some", recompute_method="block")


def test_where_upstream_checks_the_method_for_full_recomputation_alone_the_port_leaves_it(tmp_path):
    module = _transformer_config(tmp_path, TRANSFORMER_CONFIG.replace(
        "            else:\n                raise ValueError(\n                    f'Using",
        "            elif self.recompute_granularity != 'selective':\n                raise ValueError(\n                    f'Using"))
    check = module.TransformerConfig.__post_init__
    port_support.load().upstream_fixes._selective_recompute_takes_no_method(module)
    assert module.TransformerConfig.__post_init__ is check
