"""Megatron-DeepSpeed's own bugs in a window, fixed by the port's after-import steps
(``rocm_port.fork_fixes``) and, written apart, by a baseline shim: each module below has the shape
of the fork's code at 9e72d571 (2023-07-04), as far as the bug goes, loaded from a file as upstream's."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from megaport.train import failure
from megaport.train.shims import registry
from tests.support import port as port_support
from tests.test_upstream_fixes import _fixed_by, _ported, _upstream_module

BATCH, SEQ, HIDDEN = 2, 5, 3

#: gpt_model.py at 9e72d571 as far as its pipeline goes: the embedding gives [s, b, h] (upstream's
#: merge) and GPTModelPipe still transposes around its layers; DeepSpeed's PipelineModule keeps
#: callables as forward functions.
GPT_MODEL_PIPE = f'''
import torch

BATCH, SEQ = {BATCH}, {SEQ}


class PipelineModule(torch.nn.Module):
    def __init__(self, layers, topology=None):
        super().__init__()
        self.forward_funcs = list(layers)

    def forward(self, tokens):
        for function in self.forward_funcs:
            tokens = function(tokens)
        return tokens


class Embedding:
    def forward(self, tokens):
        embeddings = torch.stack([tokens.float(), tokens.float() ** 2, -tokens.float()], dim=-1)
        # Data format change to avoid explicit tranposes : [b s h] --> [s b h].
        embeddings = embeddings.transpose(0, 1).contiguous()
        return embeddings


class EmbeddingPipe(Embedding):
    def __call__(self, tokens):
        return self.forward(tokens)


class ParallelTransformerLayerPipe:
    """Takes [s, b, h], as upstream's layers do: its causal mask is [b, 1, s, s]."""

    def __call__(self, hidden_states):
        attention_mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
        attention_scores = torch.einsum("sbh,tbh->bst", hidden_states, hidden_states).unsqueeze(1)
        attention_scores.masked_fill_(attention_mask, -10000.0)
        probs = attention_scores.softmax(-1).squeeze(1)
        return torch.einsum("bst,tbh->sbh", probs, hidden_states)


class GPTModelPipe(PipelineModule):
    def __init__(self, fp32_residual_connection=False):
        self.specs = [EmbeddingPipe()]
        if fp32_residual_connection:
            self.specs.append(lambda x: x.transpose(0, 1).contiguous().float())
        else:
            self.specs.append(lambda x: x.transpose(0, 1).contiguous())
        self.specs.append(ParallelTransformerLayerPipe())
        # Undo data format change
        self.specs.append(lambda x: x.transpose(0, 1).contiguous())
        super().__init__(layers=self.specs, topology=None)
'''
#: before the merge (c24020485d … f01c9e6e1e) the embedding gave [b, s, h]: the transposes were right
GPT_MODEL_PIPE_BEFORE = GPT_MODEL_PIPE.replace("        embeddings = embeddings.transpose(0, 1).contiguous()\n", "")


def _gpt_model(tmp_path, source=GPT_MODEL_PIPE):
    return _upstream_module(tmp_path / "megatron/model/gpt_model.py", "megatron.model.gpt_model", source)


def _tokens():
    return torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) % 4


def test_unfixed_the_pipeline_attends_over_the_batch_and_the_shim_answers_its_failure(tmp_path):
    with pytest.raises(RuntimeError, match="at non-singleton dimension 3") as raised:
        _gpt_model(tmp_path).GPTModelPipe()(_tokens())
    assert registry.pick([failure.from_exception(raised.value)], []) == "fork-pipe-transposes"


@pytest.mark.parametrize("fix", ["port", "shim"])
@pytest.mark.parametrize("fp32_residual", [False, True])
def test_the_pipeline_gives_its_layers_s_b_h_as_the_forks_fix_does(tmp_path, fix, fp32_residual):
    """The fixed pipeline computes what the pipeline before the merge computed: one transpose in all."""
    before = _gpt_model(tmp_path / "before", GPT_MODEL_PIPE_BEFORE).GPTModelPipe(fp32_residual)(_tokens())
    module = _gpt_model(tmp_path / "after")
    if fix == "port":
        _ported(module)
    else:
        registry.REGISTRY["fork-pipe-transposes"].layers_without_transposes(module)
    after = module.GPTModelPipe(fp32_residual)(_tokens())
    assert after.shape == (SEQ, BATCH, 3)
    torch.testing.assert_close(after, before.transpose(0, 1), rtol=0, atol=0)


def test_before_the_merge_the_port_keeps_the_pipelines_transposes(tmp_path):
    module = _ported(_gpt_model(tmp_path, GPT_MODEL_PIPE_BEFORE))
    assert sum(getattr(f, "__name__", "") == "<lambda>" for f in module.GPTModelPipe().forward_funcs) == 2


#: checkpointing.py at 9e72d571 under --deepspeed, and DeepSpeed's engine as far as its save goes
CHECKPOINTING = '''
def save_checkpoint(iteration, model, optimizer, opt_param_scheduler):
    original_state_dict = model[0].module.state_dict
    model[0].module.state_dict = model[0].module.state_dict_for_save_checkpoint
    model[0].save_checkpoint("folder", client_state={"iteration": iteration})
    model[0].module.state_dict = original_state_dict
'''


class _GPTModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):  # the merge's: no destination
        return {f"{prefix}language_model": torch.nn.Module.state_dict(self, prefix=prefix, keep_vars=keep_vars)}


class _Engine:
    def __init__(self, module):
        self.module, self.saved = module, None

    def save_checkpoint(self, folder, client_state=None):
        self.saved = self.module.state_dict(destination=None, prefix="", keep_vars=False)


def _checkpointing(tmp_path):
    return _upstream_module(tmp_path / "megatron/checkpointing.py", "megatron.checkpointing", CHECKPOINTING)


def test_unfixed_no_checkpoint_is_written_and_the_shim_answers_it(tmp_path):
    engine = _Engine(_GPTModel())
    with pytest.raises(TypeError, match="unexpected keyword argument 'destination'") as raised:
        _checkpointing(tmp_path).save_checkpoint(15, [engine], None, None)
    assert registry.pick([failure.from_exception(raised.value)], []) == "fork-save-destination"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_deepspeed_saves_the_models_checkpoint_state_as_the_forks_fix_does(tmp_path, fix):
    module = _fixed_by(_checkpointing(tmp_path), fix, "fork-save-destination", "destination_taken")
    model = _GPTModel()
    engine = _Engine(model)
    module.save_checkpoint(15, [engine], None, None)
    assert list(engine.saved) == ["language_model"] and torch.equal(engine.saved["language_model"]["weight"], torch.ones(2))
    assert model.state_dict()["weight"].shape == (2,)  # the model's own state_dict is back
    assert "state_dict_for_save_checkpoint" not in vars(model)


#: training.py of the fork as far as its engine's set-up goes: DeepSpeed's engine wraps the model and
#: never calls Megatron's allreduce_layernorm_grads
TRAINING = '''
import types

import torch

deepspeed = types.SimpleNamespace(__name__="deepspeed")
ARGS = types.SimpleNamespace(deepspeed=True, sequence_parallel=True)
mpu = types.SimpleNamespace(get_tensor_model_parallel_world_size=torch.distributed.get_world_size,
                            get_tensor_model_parallel_group=lambda: torch.distributed.group.WORLD)


def get_args():
    return ARGS


class DeepSpeedEngine(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def setup_model_and_optimizer(model_provider_func, model_type=None):
    return [DeepSpeedEngine(model_provider_func())], "optimizer", "scheduler"
'''


def _norm_and_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    model[0].weight.sequence_parallel = True  # the norm: each rank sees its part of the sequence
    return model


def _grads_rank(rank: int, port: int, out_dir: str, fix: str, engine: bool) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    module = _upstream_module(__import__("pathlib").Path(out_dir) / f"r{rank}/megatron/training.py",
                              "megatron.training", TRAINING)
    module.ARGS.deepspeed = engine
    if fix == "port":
        _ported(module)
    (model, *rest) = module.setup_model_and_optimizer(_norm_and_linear)
    torch.manual_seed(1 + rank)  # this rank's part of the sequence
    model[0].module(torch.randn(3, 4)).square().sum().backward()
    grads = {name: p.grad.tolist() for name, p in model[0].module.named_parameters()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump({"grads": grads, "rest": rest}, handle)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _grads(tmp_path, fix: str, engine: bool = True) -> list:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_grads_rank, args=(port, str(tmp_path), fix, engine), nprocs=2)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


def test_under_deepspeeds_engine_the_sequence_parallel_grads_are_summed_over_the_tp_ranks(tmp_path):
    unfixed, fixed = _grads(tmp_path / "unfixed", "none"), _grads(tmp_path / "port", "port")
    assert fixed[0]["rest"] == ["optimizer", "scheduler"]
    summed = (torch.tensor(unfixed[0]["grads"]["0.weight"]) + torch.tensor(unfixed[1]["grads"]["0.weight"]))
    assert unfixed[0]["grads"]["0.weight"] != unfixed[1]["grads"]["0.weight"]  # each rank's own part: the bug
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(fixed[rank]["grads"]["0.weight"]), summed)
        # unmarked weights keep their rank's gradient (the engine's data-parallel reduction is elsewhere)
        assert fixed[rank]["grads"]["1.weight"] == unfixed[rank]["grads"]["1.weight"]
        assert fixed[rank]["grads"]["0.bias"] == unfixed[rank]["grads"]["0.bias"]


def test_without_deepspeeds_engine_megatrons_optimizer_sums_them_and_the_port_adds_nothing(tmp_path):
    unfixed, fixed = _grads(tmp_path / "unfixed", "none", engine=False), _grads(tmp_path / "port", "port", engine=False)
    assert [r["grads"] for r in fixed] == [r["grads"] for r in unfixed]


def test_an_upstream_training_module_without_deepspeed_is_left_alone(tmp_path):
    module = _upstream_module(tmp_path / "megatron/training.py", "megatron.training",
                              "def setup_model_and_optimizer(*args):\n    return [None], None, None\n")
    setup = module.setup_model_and_optimizer
    assert _ported(module).setup_model_and_optimizer is setup


def test_the_fork_fixes_are_after_import_steps_of_the_modules_they_fix():
    port = port_support.load()
    for name, step in (("megatron.training", "_sequence_parallel_grads_summed_under_deepspeed"),
                       ("megatron.model.gpt_model", "_pipe_transposes_once"),
                       ("megatron.model.gpt_model", "_model_takes_the_pipes_patterns"),
                       ("megatron.checkpointing", "_deepspeed_save_takes_destination"),
                       ("megatron.checkpointing", "_load_takes_load_only_weights")):
        assert step in [s.__name__ for s in port.after_import_steps(name)], name


#: gpt_model.py at 71e8407c … df0e2e42 as far as its universal-checkpoint info goes
UNIVERSAL_INFO = '''
class GPTModel:
    def _get_vocab_param_patterns(self):
        return [r"tied_modules.embed.word_embeddings.weight"]

    def universal_checkpoint_info(self):
        return {"vocabulary": self._get_vocab_param_patterns(),
                "tp_replicated": self._get_tp_replicated_param_patterns(),
                "row_parallel": self._get_row_parallel_param_patterns()}


class GPTModelPipe:
    @staticmethod
    def _get_tp_replicated_param_patterns():
        return [r"\\d+.input_layernorm.weight"]

    @staticmethod
    def _get_row_parallel_param_patterns():
        return [r"\\d+.mlp.dense_4h_to_h.weight"]
'''


def test_unfixed_gpt_models_universal_info_asks_for_the_pipes_methods_and_the_port_gives_them(tmp_path):
    with pytest.raises(AttributeError, match="_get_tp_replicated_param_patterns"):
        _gpt_model(tmp_path / "unfixed", UNIVERSAL_INFO).GPTModel().universal_checkpoint_info()
    module = _ported(_gpt_model(tmp_path / "port", UNIVERSAL_INFO))
    assert module.GPTModel().universal_checkpoint_info() == {
        "vocabulary": [r"tied_modules.embed.word_embeddings.weight"], "tp_replicated": [r"\d+.input_layernorm.weight"],
        "row_parallel": [r"\d+.mlp.dense_4h_to_h.weight"]}
    assert module.GPTModelPipe._get_tp_replicated_param_patterns() == [r"\d+.input_layernorm.weight"]


#: load_checkpoint at 9e72d571: the merge dropped its load_only_weights parameter, which it still reads
LOAD_CHECKPOINT = '''
def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', strict=True):
    state_dict = {"iteration": 15}
    if load_only_weights:
        iteration = 0
    else:
        iteration = state_dict["iteration"]
    return iteration
'''


def _loading(tmp_path):
    return _upstream_module(tmp_path / "megatron/checkpointing.py", "megatron.checkpointing", LOAD_CHECKPOINT)


def test_unfixed_no_resume_starts_and_the_shim_answers_it(tmp_path):
    with pytest.raises(NameError, match="load_only_weights") as raised:
        _loading(tmp_path).load_checkpoint([None], None, None)
    assert registry.pick([failure.from_exception(raised.value)], []) == "fork-load-only-weights"


@pytest.mark.parametrize("fix", ["port", "shim"])
def test_a_resume_loads_its_iteration_as_the_forks_fix_does(tmp_path, fix):
    module = _fixed_by(_loading(tmp_path), fix, "fork-load-only-weights", "load_only_weights_false")
    assert module.load_checkpoint([None], None, None) == 15
    if fix == "port":  # the fork's parameter back: a call asking for the weights alone gets them
        assert module.load_checkpoint([None], None, None, strict=True, load_only_weights=True) == 0
