"""The baseline's shims: one module each, picked by the exception and the frame that raised it,
computing what apex/TE/upstream's later fix computes, and never the port's code."""

from __future__ import annotations

import contextlib
import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megaport.train import failure
from megaport.train.shims import audit, registry
from support.upstream_shapes import HF_WRAPPER_2025

SRC = Path(registry.__file__).resolve().parents[3]  # the folder holding the megaport package


def _failure_of(code: str, folder: Path | None = None) -> failure.Failure:
    """The failure ``code`` dies of, in this process (``folder`` first on sys.path), as unported
    upstream meets it: without the import finders the port (loaded by other tests here) and the
    shims put on sys.meta_path, which serve exactly these failures away."""
    if folder is not None:
        sys.path.insert(0, str(folder))
    finders = list(sys.meta_path)
    sys.meta_path[:] = [f for f in finders if "rocm_port" not in type(f).__module__
                        and type(f).__module__ != "megaport.train.hooks"]
    try:
        exec(compile(textwrap.dedent(code), "<failing>", "exec"), {})
    except Exception as exc:  # noqa: BLE001 - the failure is the point
        return failure.from_exception(exc)
    finally:
        sys.meta_path[:] = finders
        if folder is not None:
            sys.path.remove(str(folder))
            for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
                del sys.modules[name]
    raise AssertionError(f"{code!r} did not fail")


def _fake_upstream(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_every_shim_is_a_module_with_its_description_and_pattern():
    """Each shim answers a failure (its pattern) or is one a model family, or a check that resumes or
    writes a checkpoint, starts its baseline with."""
    from megaport.train import baseline
    from megaport.train.checks import cross_load
    from megaport.train.families import registry as families

    up_front = {name for family in families.FAMILIES.values() for name in family.baseline_shims}
    up_front |= set(baseline.LOADING_SHIMS) | set(cross_load.WRITING)
    assert len(registry.REGISTRY) == 47
    for name, shim in registry.REGISTRY.items():
        assert shim.NAME == name
        for field in ("DESCRIPTION", "ERAS", "REPRODUCES"):
            assert isinstance(getattr(shim, field), str) and getattr(shim, field), (name, field)
        assert (shim.PATTERN or name in up_front) and callable(shim.install), name


def test_no_shim_reads_imports_or_copies_the_port():
    """Written apart from the port: nothing in the shims names the port's package."""
    for path in Path(registry.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
        assert not [m for m in imported if "replacements" in m or "rocm_port" in m], path
        text = path.read_text(encoding="utf-8")
        assert not any(f"rocm_port{end}" in text for end in (".py", "/")) or path.name == "audit.py", path


def _missing(module: str) -> str:
    """Code that fails as importing a missing ``module`` does, whatever this process has loaded
    (other tests may have served or blocked it here)."""
    return f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})"


@pytest.mark.parametrize("code,shim", [
    (_missing("amp_C"), "apex"),
    (_missing("apex.optimizers"), "apex"),
    (_missing("fused_mix_prec_layer_norm_cuda"), "apex"),
    ("raise ValueError('Apex must be installed to use FusedLayerNorm.')", "apex"),
    ("raise AssertionError('Please install Apex or Transformer Engine to use DistributedOptimizer.')", "apex"),
    (_missing("transformer_engine"), "transformer-engine"),
    ("import importlib.metadata as m\nm.version('transformer-engine')", "transformer-engine"),
    (_missing("torch._six"), "stack"),
    ("raise AttributeError(\"module 'numpy' has no attribute 'float'.\")", "stack"),
    ("raise AttributeError(\"'torch.storage.TypedStorage' object has no attribute '_untyped'\")", "stack"),
    (failure.Failure("ModuleNotFoundError", "No module named 'deepspeed.compression.compress'",
                     module="deepspeed.compression.compress"), "deepspeed-compression"),  # DeepSpeed >= 0.18
    ("isinstance(1, 2)", "deepspeed-tensor-types"),
    ("class Timers:\n    pass\nTimers().timers", "fork-deepspeed-train"),
    ("from megaport.train.shims.te_import_stub import TransformerEngineStubUsed\n"
     "raise TransformerEngineStubUsed('TransformerEngine is not installed when instantiating TEDotProductAttention')",
     "te-spec"),
    ("raise ValueError('Transformer Engine v0.0.0+megaport.stub does not support Grouped Query Attention, use a "
     "newer version of Transformer Engine.')", "te-spec"),  # core 0.5's Mixtral: GQA refused by the stub's version
    ("raise ValueError('Transformer Engine v1.2 does not support Grouped Query Attention')", None),  # a real TE's
    ("raise AssertionError('zero_centered_gamma not supported by torch LayerNorm')", "te-norm"),
    ("raise AssertionError('(RMSNorm) is not supported in FusedLayerNorm')", "te-norm"),
    ("TENorm", "te-norm"),
    ("te_general_gemm", "te-norm"),
    ("raise AssertionError('Grouped GEMM is not available. Please run `pip install grouped_gemm`.')", "grouped-gemm"),
    ("import argparse, io, torch\nb = io.BytesIO()\ntorch.save({'args': argparse.Namespace()}, b)\nb.seek(0)\n"
     "torch.load(b)", "torch-load-trusting"),
    ("def f(**kw):\n    pass\nf(1, k_channels=3)", None),  # a TypeError of another shape
    ("class DotProductAttention:\n    def __init__(self):\n        pass\nDotProductAttention(k_channels=3)",
     "mla-attention"),
    ("import os\nos.path.join(None, 'bin', 'nvcc')", None),  # outside upstream's kernel build
    ("raise AssertionError('loss is nan')", None),
    ("import torch\ntorch.ones(4, 4).t().view(16)", None),  # a view failure in no shim's frame
])
def test_a_shim_answers_only_its_own_failure(code, shim):
    found = code if isinstance(code, failure.Failure) else _failure_of(code)
    assert registry.pick([found], []) == shim, found
    if shim:
        assert registry.pick([found], [shim]) is None  # never twice


def test_the_two_view_failures_are_told_apart_by_the_frame_that_raised(tmp_path):
    tree = _fake_upstream(tmp_path, {
        "megatron/__init__.py": "",
        "megatron/mpu/__init__.py": "",
        "megatron/mpu/layers.py": """
            import torch
            def backward(grad_output):
                grad_output = grad_output.view(16)
            """,
        "megatron/model/__init__.py": "",
        "megatron/model/transformer.py": """
            import torch
            def forward(mixed):
                query_layer = mixed.view(16)
            """})
    wgrad = _failure_of("from megatron.mpu.layers import backward\nimport torch\nbackward(torch.ones(4, 4).t())", tree)
    attention = _failure_of("from megatron.model.transformer import forward\nimport torch\n"
                            "forward(torch.ones(4, 4).t())", tree)
    assert registry.pick([wgrad], []) == "wgrad-contiguous"
    assert registry.pick([attention], []) == "fork-attention-view"


def test_the_loss_scale_shim_answers_the_forks_log_line_only(tmp_path):
    """Megatron-DeepSpeed before 3ed9f4f7 formats the optimizer's cur_scale, None with today's
    DeepSpeed at ZeRO stage 0, into its log line; None formatted anywhere else is not its failure."""
    tree = _fake_upstream(tmp_path, {
        "megatron/__init__.py": "",
        "megatron/training.py": """
            def training_log(loss_scale, other=None):
                log_string = ''
                log_string += ' loss scale: {:.1f} |'.format(loss_scale)
            def elsewhere(value):
                return '{:.1f}'.format(value)
            """})
    log_line = _failure_of("from megatron.training import training_log\ntraining_log(None)", tree)
    other = _failure_of("from megatron.training import elsewhere\nelsewhere(None)", tree)
    assert registry.pick([log_line], []) == "deepspeed-loss-scale"
    assert registry.pick([other], []) is None


def test_the_loss_scale_shim_gives_todays_fp16_optimizers_cur_scale_again():
    import types

    from megaport.train.shims import deepspeed_loss_scale

    class LossScaleConfig:
        cur_scale = 4096.0

    class FP16_Optimizer:
        def __init__(self):
            self.loss_scale_config = LossScaleConfig()

    module = types.SimpleNamespace(LossScaleConfig=LossScaleConfig, FP16_Optimizer=FP16_Optimizer)
    deepspeed_loss_scale.scale_again(module)
    optimizer = FP16_Optimizer()
    assert optimizer.cur_scale == 4096.0
    optimizer.cur_scale = 2048.0
    assert optimizer.loss_scale_config.cur_scale == 2048.0
    # an older DeepSpeed (no LossScaleConfig): its optimizers keep cur_scale themselves, untouched
    class Old:
        pass

    deepspeed_loss_scale.scale_again(types.SimpleNamespace(FP16_Optimizer=Old))
    assert "cur_scale" not in vars(Old)


def test_the_raising_frame_is_the_trees_not_megaports_cpu_placement_or_torchs():
    """On a CPU run megaport's placement mode and torch's dispatch sit between upstream's line and
    the error (as recorded from 2022-02's unported backward)."""
    from megaport.train.failure import Frame

    plumbing = str(SRC / "megaport" / "train" / "cpu.py")
    found = failure.Failure("RuntimeError", "view size is not compatible with input tensor's size and stride", (
        Frame(plumbing, 121, "backward", "return real(self, *args)"),
        Frame("/venv/lib/python3.12/site-packages/torch/autograd/function.py", 325, "apply", "return user_fn(self, *args)"),
        Frame("/tmp/megaport-upstream-x/megatron/mpu/layers.py", 227, "backward",
              "grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1],"),
        Frame(plumbing, 106, "__torch_function__", "return func(*args, **kwargs)")))
    assert registry.pick([found], ["stack", "apex"]) == "wgrad-contiguous"


def test_the_kernel_build_is_answered_by_the_file_that_failed(tmp_path):
    tree = _fake_upstream(tmp_path, {"megatron/__init__.py": "", "megatron/fused_kernels/__init__.py": """
        import os
        def load(args):
            cuda_home = None
            os.path.join(cuda_home, 'bin', 'nvcc')
        """})
    found = _failure_of("from megatron.fused_kernels import load\nload(None)", tree)
    assert found.exception == "TypeError"
    assert registry.pick([found], []) == "fused-kernel-build"


def test_berts_te_spec_built_at_import_is_answered_by_the_spec_module_that_raised(tmp_path):
    tree = _fake_upstream(tmp_path, {"bert_pkg/__init__.py": "", "bert_pkg/bert_layer_specs.py": """
        bert_layer_local_spec = "local"
        def get_bert_layer_with_transformer_engine_spec():
            raise ImportError("Transformer Engine is not installed. Please use local Bert layer spec instead.")
        def __getattr__(name):
            if name == "bert_layer_with_transformer_engine_spec":
                return get_bert_layer_with_transformer_engine_spec()
            raise AttributeError(name)
        """})
    found = _failure_of("from bert_pkg.bert_layer_specs import bert_layer_with_transformer_engine_spec", tree)
    assert registry.pick([found], []) == "bert-te-spec"
    elsewhere = _failure_of("raise ImportError('Please use local Bert layer spec instead.')")
    assert registry.pick([elsewhere], []) is None  # the same words raised outside the spec module


# core 0.9's bert_layer_specs (772faca1), in the shape it fails in without TE: the TE spec built at
# module level from names only its guarded import defines
_CORE_09_BERT_SPECS = {"megatron/__init__.py": "", "megatron/core/__init__.py": "", "megatron/core/models/__init__.py": "",
                       "megatron/core/models/bert/__init__.py": "",
                       "megatron/core/models/bert/bert_layer_specs.py": """
    try:
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear
        HAVE_TE = True
    except ImportError:
        HAVE_TE = False
    bert_layer_with_transformer_engine_spec = (TELayerNormColumnParallelLinear, TERowParallelLinear)
    bert_layer_local_spec = ("ColumnParallelLinear", "RowParallelLinear")
    """}


def test_core_09s_bert_te_spec_at_module_level_is_answered_and_imports_with_the_shim(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _CORE_09_BERT_SPECS)
    found = _failure_of("import megatron.core.models.bert.bert_layer_specs", tree)
    assert found.exception == "NameError" and registry.pick([found], []) == "bert-te-spec"
    stdout, _ = _run_baseline_process("""
        from megatron.core.models.bert import bert_layer_specs as specs
        print(specs.HAVE_TE, specs.bert_layer_local_spec == specs.get_bert_layer_with_transformer_engine_spec())
        try:
            specs.bert_layer_with_transformer_engine_spec[0]()
        except ImportError as e:
            print("refused" if "TransformerEngine" in str(e) else e)
        """, ["bert-te-spec"], tmp_path, pythonpath=[tree])
    assert stdout.split() == ["False", "True", "refused"]





def test_t5s_sentinels_on_todays_transformers_are_answered_and_read_with_the_shim(tmp_path):
    files = {"megatron/__init__.py": "", "megatron/core/__init__.py": "", "megatron/core/tokenizers/__init__.py": "",
             "megatron/core/tokenizers/text/__init__.py": "", "megatron/core/tokenizers/text/libraries/__init__.py": "",
             "megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py": HF_WRAPPER_2025}
    tree = _fake_upstream(tmp_path / "tree", files)
    found = _failure_of("""
        from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import MegatronHFTokenizer
        MegatronHFTokenizer("bert-large-cased", additional_special_tokens=["<extra_id_0>"]).additional_special_tokens_ids
        """, tree)
    assert found.exception == "AttributeError" and registry.pick([found], []) == "transformers-sentinels"
    stdout, _ = _run_baseline_process("""
        from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import MegatronHFTokenizer
        print(MegatronHFTokenizer("bert-large-cased", additional_special_tokens=["<a>", "<b>"]).additional_special_tokens_ids)
        """, ["transformers-sentinels"], tmp_path, pythonpath=[tree])
    assert stdout.strip() == "[2, 3]"


# Megatron-DeepSpeed's merged optimizers (9e72d571 … 636540a9^), as its train_step calls them
_FORK_OPTIMIZERS_2023_07 = {
    "megatron/__init__.py": """
        import types
        _ARGS = types.SimpleNamespace(name="megatron's args")
        _TIMERS = "megatron's timers"

        def get_args():
            return _ARGS

        def get_timers():
            return _TIMERS
        """,
    "megatron/optimizer/__init__.py": "",
    "megatron/optimizer/optimizer.py": """
        class MegatronOptimizer:
            gathered = []

            def gather_model_params(self, args, timers):
                self.gathered.append(args.name)

        class MixedPrecisionOptimizer(MegatronOptimizer):
            def step(self, args, timers):
                return True, 1.0, None

        class FP32Optimizer(MegatronOptimizer):
            def step(self, args, timers):
                return False, 2.0, None
        """,
}


def test_the_forks_train_step_without_deepspeed_is_answered_and_steps_with_the_shim(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _FORK_OPTIMIZERS_2023_07)
    found = _failure_of("""
        from megatron.optimizer.optimizer import MixedPrecisionOptimizer
        MixedPrecisionOptimizer().step()
        """, tree)
    assert found.exception == "TypeError" and registry.pick([found], []) == "fork-train-step"
    stdout, _ = _run_baseline_process("""
        from megatron.optimizer.optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer
        print(MixedPrecisionOptimizer().step()[:2], FP32Optimizer().step()[:2], MixedPrecisionOptimizer().step("a", "t"))
        print(MegatronOptimizer.gathered)
        """, ["fork-train-step"], tmp_path, pythonpath=[tree])
    assert stdout.splitlines() == ["(True, 1.0) (False, 2.0) (True, 1.0, None)", "[\"megatron's args\"]"]


def test_deepspeeds_fp16_optimizer_without_zero_answers_scale_loss_none_with_the_fork_shim(tmp_path):
    """The fork's MoE example runs DeepSpeed's fp16 optimizer without ZeRO (stage 0): its
    ``scale_loss`` is None under fork-deepspeed-train as ZeRO's is."""
    pytest.importorskip("deepspeed")
    stdout, _ = _run_baseline_process("""
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        print(FP16_Optimizer.scale_loss, DeepSpeedZeroOptimizer.scale_loss)
        """, ["fork-deepspeed-train"], tmp_path)
    assert stdout.strip().splitlines()[-1].split() == ["None", "None"]  # after DeepSpeed's own log lines


# upstream's fp8_utils between 062c833392 and 76203e757e (2025-04 … 07): without TE its fallback
# quantize_param_shard raises whatever it is given; the distributed optimizer calls it every step
_FP8_UTILS_2025_04 = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/core/fp8_utils.py": """
        HAVE_TE = False

        def _quantize_param_shard_impl(*args, **kwargs):
            raise RuntimeError("Invalid Transformer Engine version for FP8 distributed optimizer")

        def quantize_param_shard(model_params, main_params, start_offsets, data_parallel_group):
            _quantize_param_shard_impl(model_params, main_params, start_offsets, data_parallel_group)
        """,
}


def test_the_distributed_optimizers_fp8_shard_call_without_te_is_answered_and_passes_with_the_shim(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _FP8_UTILS_2025_04)
    found = _failure_of("""
        from megatron.core.fp8_utils import quantize_param_shard
        quantize_param_shard([], [], [], None)
        """, tree)
    assert found.exception == "RuntimeError" and registry.pick([found], []) == "fp8-shard-without-te"
    stdout, _ = _run_baseline_process("""
        from megatron.core.fp8_utils import quantize_param_shard
        print(quantize_param_shard([], [], [], None))
        try:
            quantize_param_shard(["an fp8 param"], [], [], None)
        except RuntimeError as e:
            print("refused" if "Invalid Transformer Engine" in str(e) else e)
        """, ["fp8-shard-without-te"], tmp_path, pythonpath=[tree])
    assert stdout.split() == ["None", "refused"]


def test_the_fp8_shard_shim_answers_where_te_s_import_stub_made_have_te_true(tmp_path):
    """core_v0.12.3's baseline needs the TE stub (its checkpoint load asks TE's version); fp8_utils
    then says HAVE_TE and still takes the raising fallback (the stub's version fits no TE branch)."""
    files = {**_FP8_UTILS_2025_04, "megatron/core/fp8_utils.py": _FP8_UTILS_2025_04[
        "megatron/core/fp8_utils.py"].replace("HAVE_TE = False", "HAVE_TE = True  # import transformer_engine: the stub")}
    tree = _fake_upstream(tmp_path / "tree", files)
    stdout, _ = _run_baseline_process("""
        from megatron.core.fp8_utils import quantize_param_shard
        print(quantize_param_shard([], [], [], None))
        """, ["transformer-engine", "fp8-shard-without-te"], tmp_path, pythonpath=[tree])
    assert stdout.split()[-1] == "None"


# Megatron-DeepSpeed's T5Model from 50b32515 (MoE support) to 712057c8, in the shape its run fails
# in: a language model returning one MoE loss per layer after its outputs.
_FORK_T5_MOE_LOSSES = {
    "megatron/__init__.py": "",
    "megatron/model/__init__.py": "",
    "megatron/model/language_model.py": """
        class TransformerLanguageModel:
            def __init__(self, add_decoder):
                self.add_decoder = add_decoder

            def __call__(self, *args, **kwargs):
                return self.forward(*args, **kwargs)

            def forward(self, tokens):
                outputs = ("decoder", "encoder") if self.add_decoder else ("encoder",)
                return (*outputs, "moe loss 1", "moe loss 2")

        def get_language_model(add_decoder=True, add_pooler=False):
            return TransformerLanguageModel(add_decoder), "language_model"
        """,
    "megatron/model/t5_model.py": """
        from megatron.model.language_model import get_language_model

        class T5Model:
            def __init__(self, add_decoder=True):
                self.language_model, self._language_model_key = get_language_model(add_decoder=add_decoder)

            def forward(self, tokens):
                lm_output = self.language_model(tokens)
                if self.language_model.add_decoder:
                    decoder_output, encoder_output = lm_output
                    return decoder_output
                encoder_output = lm_output
                return encoder_output
        """}


def test_the_forks_t5_moe_losses_are_answered_by_t5s_own_unpacking(tmp_path):
    tree = _fake_upstream(tmp_path, _FORK_T5_MOE_LOSSES)
    found = _failure_of("from megatron.model.t5_model import T5Model\nT5Model().forward(1)", tree)
    assert found.exception == "ValueError" and "too many values to unpack" in found.message
    assert registry.pick([found], []) == "fork-t5-moe-losses"
    elsewhere = _failure_of("a, b = (1, 2, 3)")
    assert registry.pick([elsewhere], []) is None  # the same error from another line


def test_the_forks_t5_gets_its_language_models_two_outputs(tmp_path):
    """As 712057c8 takes them: the decoder's and encoder's outputs, the MoE losses left; an
    encoder-only stage's output stays whole, as the series' patch leaves it."""
    tree = _fake_upstream(tmp_path / "tree", _FORK_T5_MOE_LOSSES)
    code = """
        from megatron.model.t5_model import T5Model
        from megatron.model.language_model import get_language_model
        print(T5Model().forward(1), T5Model(add_decoder=False).forward(1), get_language_model()[0].forward(1))
        """
    stdout, loaded = _run_baseline_process(code, ["fork-t5-moe-losses"], tmp_path, pythonpath=[tree])
    assert stdout.strip() == ("decoder ('encoder', 'moe loss 1', 'moe loss 2') "
                              "('decoder', 'encoder', 'moe loss 1', 'moe loss 2')")
    assert loaded == []


# Megatron-DeepSpeed's BertModel from 50b32515 to 712057c8, in the shape its run fails in.
_FORK_BERT_MOE_LOSSES = {
    "megatron/__init__.py": "",
    "megatron/model/__init__.py": "",
    "megatron/model/language_model.py": """
        class TransformerLanguageModel:
            def __init__(self, add_pooler):
                self.add_pooler = add_pooler

            def __call__(self, *args, **kwargs):
                return self.forward(*args, **kwargs)

            def forward(self, tokens):
                outputs = ("encoder", "pooled") if self.add_pooler else ("encoder",)
                return (*outputs, "moe loss 1", "moe loss 2")

        def get_language_model(config=None, num_tokentypes=2, add_pooler=False):
            return TransformerLanguageModel(add_pooler), "language_model"
        """,
    "megatron/model/bert_model.py": """
        from megatron.model.language_model import get_language_model

        class BertModel:
            def __init__(self, add_binary_head=True):
                self.add_binary_head = add_binary_head
                self.language_model, self._language_model_key = get_language_model(add_pooler=add_binary_head)

            def forward(self, tokens):
                lm_output = self.language_model(tokens)
                if self.add_binary_head:
                    lm_output, pooled_output = lm_output
                    return lm_output, pooled_output
                return lm_output
        """}


def test_the_forks_bert_moe_losses_are_answered_and_left_as_712057c8_leaves_them(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _FORK_BERT_MOE_LOSSES)
    found = _failure_of("from megatron.model.bert_model import BertModel\nBertModel().forward(1)", tree)
    assert found.exception == "ValueError" and registry.pick([found], []) == "fork-bert-moe-losses"
    stdout, loaded = _run_baseline_process("""
        from megatron.model.bert_model import BertModel
        print(BertModel().forward(1), BertModel(add_binary_head=False).forward(1))
        """, ["fork-bert-moe-losses"], tmp_path, pythonpath=[tree])
    assert stdout.strip() == "('encoder', 'pooled') encoder"
    assert loaded == []


# Megatron-DeepSpeed's T5Model from 62791cc6, and pretrain_t5.py's loss_func, as they end.
_FORK_T5_RETURN = {
    "megatron/__init__.py": "",
    "megatron/model/__init__.py": "",
    "megatron/model/t5_model.py": """
        class T5Model:
            def __init__(self, return_moe_loss=False):
                self.return_moe_loss = return_moe_loss

            def forward(self, tokens, lm_labels=None):
                if lm_labels is None:
                    return "logits"
                lm_loss, dec_moe_losses, enc_moe_losses = "lm loss", ["decoder"], ["encoder"]
                return lm_loss, dec_moe_losses, enc_moe_losses if self.return_moe_loss else lm_loss
        """,
    "fork_pretrain_t5.py": """
        def loss_func(loss_mask, output_tensor):
            lm_loss_ = output_tensor.float()
            return lm_loss_
        """}


def test_the_forks_t5_returns_its_loss_alone_unless_asked_for_the_moe_losses(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _FORK_T5_RETURN)
    code = """
        from megatron.model.t5_model import T5Model
        print(repr(T5Model().forward(1, lm_labels=1)), T5Model(return_moe_loss=True).forward(1, lm_labels=1),
              T5Model().forward(1))
        """
    stdout, loaded = _run_baseline_process(code, ["fork-t5-loss"], tmp_path, pythonpath=[tree])
    assert stdout.strip() == "'lm loss' ('lm loss', ['decoder'], ['encoder']) logits"
    assert loaded == []


# Megatron-DeepSpeed's BertModel from 319c9b1c, and pretrain_bert.py's loss_func before a9856ce0.
_FORK_BERT_RETURN = {
    "megatron/__init__.py": "",
    "megatron/model/__init__.py": "",
    "megatron/model/bert_model.py": """
        class BertModel:
            def __init__(self, return_moe_loss=False):
                self.return_moe_loss = return_moe_loss

            def forward(self, tokens):
                lm_output, moe_losses = ("lm loss", "sop logits"), ["moe"]
                return *lm_output, moe_losses if self.return_moe_loss else lm_output
        """,
    "fork_pretrain_bert.py": """
        def loss_func(loss_mask, sentence_order, output_tensor):
            lm_loss_, sop_logits = output_tensor
            return lm_loss_, sop_logits
        """}


#: the fork's unparenthesised conditional returns, as its loss functions meet them: (its files, the
#: failing call, the exception and message, the shim that answers, the same error from another line)
_FORK_RETURNS = {
    "fork-t5-loss": (_FORK_T5_RETURN, "from megatron.model.t5_model import T5Model\nfrom fork_pretrain_t5 import "
                     "loss_func\nloss_func(None, T5Model().forward(1, lm_labels=1))", "AttributeError",
                     "'tuple' object has no attribute 'float'", "(1, 2).float()"),
    "fork-bert-loss": (_FORK_BERT_RETURN, "from megatron.model.bert_model import BertModel\nfrom fork_pretrain_bert "
                       "import loss_func\nloss_func(None, None, BertModel().forward(1))", "ValueError",
                       "too many values to unpack (expected 2)", "a, b = (1, 2, 3)"),
}


@pytest.mark.parametrize("shim", list(_FORK_RETURNS))
def test_the_forks_conditional_returns_are_answered_where_its_loss_funcs_meet_them(tmp_path, shim):
    files, call, exception, message, elsewhere = _FORK_RETURNS[shim]
    found = _failure_of(call, _fake_upstream(tmp_path, files))
    assert found.exception == exception and found.message == message
    assert registry.pick([found], []) == shim
    assert registry.pick([_failure_of(elsewhere)], []) is None  # the same error from another line


def test_the_forks_bert_returns_its_two_outputs_unless_asked_for_the_moe_losses(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _FORK_BERT_RETURN)
    code = """
        from megatron.model.bert_model import BertModel
        from fork_pretrain_bert import loss_func
        print(loss_func(None, None, BertModel().forward(1)), BertModel(return_moe_loss=True).forward(1))
        """
    stdout, loaded = _run_baseline_process(code, ["fork-bert-loss"], tmp_path, pythonpath=[tree])
    assert stdout.strip() == "('lm loss', 'sop logits') ('lm loss', 'sop logits', ['moe'])"
    assert loaded == []


# Megatron-DeepSpeed's train() from its 2023-07 merge: the loss scaling set on a fresh config.
_FORK_FRESH_CONFIG = {
    "pretrain_gpt.py": "import torch\nimport deepspeed\n",  # the catalogue's mark of the fork
    "megatron/__init__.py": """
        import types
        _ARGS = types.SimpleNamespace(deepspeed=False)

        def get_args():
            return _ARGS
        """,
    "megatron/core/__init__.py": "",
    "megatron/core/utils.py": """
        def get_model_config(model):
            return model.config
        """,
    "megatron/arguments.py": """
        import types

        def core_transformer_config_from_args(args):
            return types.SimpleNamespace(grad_scale_func=None)
        """,
    "megatron/training.py": """
        from megatron import get_args
        from megatron.arguments import core_transformer_config_from_args

        def pretrain(model, optimizer):
            return train(None, model, optimizer, None)

        def train(forward_step_func, model, optimizer, opt_param_scheduler):
            args = get_args()
            config = core_transformer_config_from_args(args)
            if not args.deepspeed:
                config.grad_scale_func = optimizer.scale_loss
            return model[0].config.grad_scale_func  # what the schedules read
        """}


def test_the_forks_fp16_loss_scale_is_listed_for_the_forks_trees_with_the_fresh_config(tmp_path):
    from megaport.train.families import registry as families

    assert all("fork-fp16-loss-scale" in families.get(name).baseline_shims for name in ("bert", "t5"))
    fork = _fake_upstream(tmp_path / "fork", _FORK_FRESH_CONFIG)
    assert registry.applies("fork-fp16-loss-scale", str(fork))
    fixed = _fake_upstream(tmp_path / "fixed", {**_FORK_FRESH_CONFIG, "megatron/training.py": """
        def train(forward_step_func, model, optimizer, opt_param_scheduler):
            config = get_model_config(model[0])
            config.grad_scale_func = optimizer.scale_loss
        """})
    assert not registry.applies("fork-fp16-loss-scale", str(fixed))  # upstream's 0b14cc27cc
    upstream = _fake_upstream(tmp_path / "upstream", {**_FORK_FRESH_CONFIG, "pretrain_gpt.py": "import torch\n"})
    assert not registry.applies("fork-fp16-loss-scale", str(upstream))  # the port's series leave it as it is


def test_the_forks_fp16_loss_scale_reaches_the_models_config(tmp_path):
    tree = _fake_upstream(tmp_path / "tree", _FORK_FRESH_CONFIG)
    code = """
        import types
        from megatron.training import pretrain
        optimizer = types.SimpleNamespace(scale_loss="scale_loss")
        print(pretrain([types.SimpleNamespace(config=types.SimpleNamespace(grad_scale_func=None))], optimizer))
        """
    stdout, loaded = _run_baseline_process(code, ["fork-fp16-loss-scale"], tmp_path, pythonpath=[tree])
    assert stdout.strip() == "scale_loss" and loaded == []
    stdout, _ = _run_baseline_process(code, [], tmp_path, pythonpath=[tree])
    assert stdout.strip() == "None"  # the fork's own train()


def test_a_failure_raised_from_another_is_matched_through_its_chain():
    found = _failure_of("try:\n    import amp_C\nexcept ImportError as exc:\n    raise RuntimeError('no kernels') from exc")
    assert [f.exception for f in found.chain()] == ["RuntimeError", "ModuleNotFoundError"]
    assert registry.pick([found], []) == "apex"


def test_failures_round_trip_through_the_failure_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(failure.FAILURE_DIR_ENV, str(tmp_path))
    try:
        import amp_C  # noqa: F401
    except ImportError as exc:
        failure.record(exc)
    (read,) = failure.read(tmp_path)
    assert read.exception == "ModuleNotFoundError" and read.module == "amp_C"
    assert registry.pick([read], []) == "apex"


def _run_baseline_process(code: str, names: list, tmp_path: Path, src: Path = SRC, pythonpath=()) -> tuple:
    """``code`` in a fresh interpreter set up as a baseline process (shims ``names``, megaport
    from ``src``, then ``pythonpath``): (its stdout, what its audit reported)."""
    audits = tmp_path / "audits"
    audits.mkdir(exist_ok=True)
    paths = os.pathsep.join([str(src), *map(str, pythonpath)])
    env = registry.environment({"PATH": os.environ.get("PATH", ""), "PYTHONPATH": paths}, names)
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(SRC), str(src))
    env[audit.AUDIT_DIR_ENV] = str(audits)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, audit.read(audits)


_USE_EVERY_SHIM = """
import importlib, numpy as np, torch
from torch._six import inf
import amp_C, apex, fused_mix_prec_layer_norm_cuda, fused_layer_norm_cuda, fused_weight_gradient_mlp_cuda
import fused_dense_cuda, transformer_engine
from apex.optimizers import FusedAdam, FusedSGD
from apex.multi_tensor_apply import multi_tensor_applier
from apex.normalization import MixedFusedRMSNorm
from apex.normalization.fused_layer_norm import FusedLayerNorm, FusedLayerNormAffineFunction
from apex.contrib.layer_norm.layer_norm import FastLayerNormFN
import grouped_gemm
assert grouped_gemm.ops.gmm(torch.ones(3, 2), torch.ones(2, 2, 4), [1, 2]).shape == (3, 4)
print("ok")
"""


def test_the_baseline_loads_nothing_of_the_port(tmp_path):
    """Every shim installed and used, as a baseline process: its audit finds no port module and no
    port finder on sys.meta_path."""
    stdout, loaded = _run_baseline_process(_USE_EVERY_SHIM, list(registry.REGISTRY), tmp_path)
    assert stdout.split() == ["ok"]
    assert loaded == [], loaded


@pytest.mark.parametrize("folder, module", [
    ("rocm_port", "rocm_port"),  # the package
    ("megatron/core/rocm_port", "megatron.core.rocm_port.softmax"),  # one of its modules, as a tree has it
    ("renamed", "renamed.attention"),  # one of its modules, the package under another name: by its marks
])
def test_the_audit_sees_the_port_when_a_process_loads_it(tmp_path, folder, module):
    """The proof above can fail: a process that imports any part of the port is reported, the module
    it asked for and the finders the package installed."""
    from megaport.replacements import render

    for path, text in render(fully_masked_rows_are_zero=True, tree_path=folder).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    for package in ("megatron", "megatron/core"):
        if (tmp_path / package).is_dir():
            (tmp_path / package / "__init__.py").write_text("")
    code = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport {module}\nprint('loaded')"
    _, loaded = _run_baseline_process(code, [], tmp_path)
    package = folder.replace("/", ".")
    assert {f"module {package}", f"module {module}"} <= set(loaded), loaded
    assert {f"finder {package}.blocker._ImportBlocker", f"finder {package}.hooks._ServeAfterImport"} <= set(loaded), loaded


def test_a_rank_stopped_while_it_writes_its_audit_leaves_no_half_report(tmp_path, monkeypatch):
    """torchrun stops the other ranks when one ends: a rank stopped inside its exit-time report had
    left an empty audit-*.json, and reading the folder failed the whole check (e6-2024-06, GPT
    tp2-pp2 against unported upstream: JSONDecodeError). A report is whole or absent."""
    from megaport.train.shims import audit

    monkeypatch.setenv(audit.AUDIT_DIR_ENV, str(tmp_path))
    Path(tmp_path, "audit-1.json").write_text(json.dumps(["module rocm_port"]), encoding="utf-8")  # a rank that finished

    def stopped_midway(self, text, encoding=None):
        with open(self, "w", encoding=encoding):
            pass
        raise SystemExit(143)

    monkeypatch.setattr(Path, "write_text", stopped_midway)
    with pytest.raises(SystemExit):
        audit.report_port_code()
    monkeypatch.undo()
    assert audit.read(tmp_path) == ["module rocm_port"]


_APEX_VALUES = """
import json, torch
torch.manual_seed(0)
import amp_C, fused_mix_prec_layer_norm_cuda as ln
from apex.optimizers import FusedAdam
from apex.multi_tensor_apply import multi_tensor_applier
x, w, b = torch.randn(6, 8), torch.rand(8) + 0.5, torch.randn(8)
out, mean, invvar = ln.forward_affine(x, (8,), w, b, 1e-5)
grads = [torch.randn(5), torch.randn(3, 3)]
flag = torch.zeros(1, dtype=torch.int)
total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)
scaled = [torch.empty_like(g) for g in grads]
multi_tensor_applier(amp_C.multi_tensor_scale, flag, [grads, scaled], 0.5)
p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
adam = FusedAdam([p], lr=0.1)
adam.step()
q, r = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
q.grad = r.grad = torch.full((3,), 0.5)
FusedAdam([q], lr=0.1, weight_decay=0.1).step()
torch.optim.AdamW([r], lr=0.1, weight_decay=0.1).step()
print(json.dumps({
    "is_fused_adam": isinstance(adam, FusedAdam) and torch.allclose(q, r, rtol=1e-6, atol=1e-7),
    "apex_state": adam.param_groups[0]["step"] == 1 and set(adam.state[p]) == {"exp_avg", "exp_avg_sq"},
    "layer_norm": torch.allclose(out, torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5), atol=1e-5),
    "l2norm": torch.allclose(total, torch.cat([g.flatten() for g in grads]).norm().reshape(1)),
    "scale": all(torch.equal(s, g * 0.5) for s, g in zip(scaled, grads)),
    "adam": torch.allclose(p.detach(), torch.full((3,), 0.9))}))
"""


def test_a_planted_fault_in_the_ports_standins_never_reaches_the_baseline(tmp_path):
    """megaport's own copy of the port's apex substitutes given wrong layer norm, grad norm, scaling
    and Adam: the baseline's apex still computes torch's values (its shims share no code with the port)."""
    copy = tmp_path / "src"
    shutil.copytree(SRC / "megaport", copy / "megaport", ignore=shutil.ignore_patterns("__pycache__"))
    port = copy / "megaport" / "replacements" / "rocm_port" / "apex_substitutes.py"
    text = port.read_text(encoding="utf-8")
    faults = {"    return out, mean.reshape(flat), rstd.reshape(flat)": "    return out * 3, mean.reshape(flat), "
                                                                       "rstd.reshape(flat)",
              "    total = torch.linalg.vector_norm(norms).reshape(1)": "    total = torch.linalg.vector_norm(norms)"
                                                                        ".reshape(1) * 100",
              "    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])": "    srcs, dsts = list(tensor_lists[0]), "
                                                                                "list(tensor_lists[1]); scale = 1.0",
              "            super().__init__(params, *args, **kwargs)": "            kwargs['lr'] = 10.0\n"
                                                                     "            super().__init__(params, *args, **kwargs)"}
    for good, bad in faults.items():
        assert text.count(good) == 1, good
        text = text.replace(good, bad)
    port.write_text(text, encoding="utf-8")
    stdout, loaded = _run_baseline_process(_APEX_VALUES, ["apex"], tmp_path, src=copy)
    assert json.loads(stdout.splitlines()[-1]) == {"is_fused_adam": True, "apex_state": True, "layer_norm": True,
                                                  "l2norm": True, "scale": True, "adam": True}
    assert loaded == []


def test_apex_shims_fused_adam_keeps_apex_s_state_and_torch_s_values():
    """An NVIDIA box's checkpoint holds apex's layout (the step in the param group, no per-parameter
    step), which the baseline's stand-in writes and reads back; its updates are AdamW's (L2 Adam's
    with ``adam_w_mode=False``), a resumed optimizer stepping on as the uninterrupted one."""
    import copy

    import torch

    from megaport.train.shims import apex_pytorch as apex

    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]

    def grads(ps, step):
        for i, p in enumerate(ps):
            p.grad = torch.full_like(p, 0.1 * (step + 1) * (i + 1)) * torch.sign(p.detach())

    for w_mode, reference in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        ours, theirs = params(), params()
        fused, torch_adam = apex.FusedAdam(ours, lr=0.05, weight_decay=0.1, adam_w_mode=w_mode), \
            reference(theirs, lr=0.05, weight_decay=0.1)
        for step in range(3):
            grads(ours, step), grads(theirs, step)
            fused.step(), torch_adam.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert fused.state_dict()["param_groups"][0]["step"] == 3
    assert all(set(s) == {"exp_avg", "exp_avg_sq"} for s in fused.state_dict()["state"].values())
    resumed_params = [p.detach().clone().requires_grad_() for p in ours]
    resumed = apex.FusedAdam(resumed_params, lr=0.05, weight_decay=0.1, adam_w_mode=False)
    resumed.load_state_dict(copy.deepcopy(fused.state_dict()))  # as a checkpoint gives it: no tensor shared
    grads(ours, 3), grads(resumed_params, 3)
    fused.step(), resumed.step()
    for a, b in zip(ours, resumed_params):
        assert torch.equal(a, b)


def test_apex_shim_agrees_with_torch_in_mixed_precision_and_backward():
    """The layer-norm extension's fp16 forward (output in the weight's dtype, fp32 statistics) and
    its backward against autograd through torch's layer norm in fp64."""
    import torch

    from megaport.train.shims import apex_pytorch as apex

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, dtype=torch.float16)
    w, b = (torch.rand(16) + 0.5).half(), torch.randn(16).half()
    out, mean, invvar = apex.forward_affine(x, (16,), w, b, 1e-5)
    assert out.dtype == torch.float16 and mean.dtype == invvar.dtype == torch.float32 and mean.shape == (12,)
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    want = torch.nn.functional.layer_norm(ref[0], (16,), ref[1], ref[2], 1e-5)
    torch.testing.assert_close(out.double(), want.detach(), atol=2e-3, rtol=2e-3)
    g = torch.randn(4, 3, 16, dtype=torch.float16)
    want.backward(g.double())
    got = apex.backward_affine(g, mean, invvar, x, (16,), w, b, 1e-5)
    for mine, theirs, tensor in zip(got, ref, (x, w, b)):
        assert mine.dtype == tensor.dtype
        torch.testing.assert_close(mine.double(), theirs.grad, atol=2e-2, rtol=2e-2)


def test_the_baseline_runs_the_same_megaport_as_the_process_comparing_with_it(tmp_path, monkeypatch):
    """A source checkout (a maintainer's, a worktree's): the baseline's processes import megaport
    from the same folder, so its shims and launcher are the ones that judge its failures; the
    tree's PYTHONPATH never reaches them."""
    from megaport.train import baseline

    repo = tmp_path / "upstream"
    repo.mkdir()
    (repo / "pretrain_gpt.py").write_text("print('unported')\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "unported"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    monkeypatch.setenv("PYTHONPATH", str(repo))
    with baseline.unported_upstream(str(repo), sha) as (folder, env):
        assert (Path(folder) / "pretrain_gpt.py").read_text() == "print('unported')\n"
        paths = env.get("PYTHONPATH", "").split(os.pathsep)
        assert str(repo) not in paths
        if "site-packages" not in str(SRC):
            assert paths == [str(SRC)]
        code = "import megaport, os; print(os.path.dirname(os.path.dirname(megaport.__file__)))"
        where = subprocess.run([sys.executable, "-c", code], env=env, cwd=folder, capture_output=True, text=True)
        assert where.stdout.strip() == str(SRC), where.stderr


def _softmax_module(name: str):
    """A stand-in for upstream's softmax module: its unfused path fills -10000 and normalises."""
    import types

    module = types.ModuleType(name)

    class FusedScaleMaskSoftmax:
        def __init__(self, sixteen_bit):
            self.input_in_float16 = sixteen_bit

        def forward_torch_softmax(self, input, mask):
            return torch.softmax(input.masked_fill(mask, -10000.0), dim=-1)

    module.FusedScaleMaskSoftmax = FusedScaleMaskSoftmax
    return module


def test_kernel_masked_rows_gives_fully_masked_rows_the_kernels_zeros():
    from megaport.train.shims import kernel_masked_rows

    module = _softmax_module("megatron.model.fused_softmax")
    kernel_masked_rows.zero_fully_masked_rows(module)
    scores = torch.randn(2, 3, 4, 5)
    mask = torch.zeros(2, 1, 4, 5, dtype=torch.bool)
    mask[0, 0, 1] = True  # one fully masked query row
    mask[1, 0, 2, :3] = True  # a partly masked one
    probs = module.FusedScaleMaskSoftmax(sixteen_bit=True).forward_torch_softmax(scores, mask)
    assert torch.equal(probs[0, :, 1], torch.zeros(3, 5))
    want = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)
    keep = ~mask.all(-1, keepdim=True).expand_as(probs)
    assert torch.equal(probs[keep], want[keep])
    fp32 = module.FusedScaleMaskSoftmax(sixteen_bit=False).forward_torch_softmax(scores, mask)
    assert torch.equal(fp32, want), "upstream's fp32 takes the unfused path with its fusions on too"


def test_kernel_masked_rows_applies_where_the_trees_kernel_zeroes_rows(tmp_path):
    """The tree's own kernel source decides (76db958327's per-row scale); trees without one take
    the kernel from apex or TE, which zero such rows."""
    from megaport.train.shims import kernel_masked_rows

    header = "megatron/fused_kernels/scaled_masked_softmax.h"
    before = _fake_upstream(tmp_path / "2022-06", {header: "out[element] = elements[i][it + element] / sum[i];"})
    after = _fake_upstream(tmp_path / "2022-08", {header: "scale_value[i] = (max_value[i] == -10000.0) ? 0.0 : 1.0;"})
    without = _fake_upstream(tmp_path / "2024", {"megatron/core/fusions/fused_softmax.py": ""})
    assert [registry.applies("kernel-masked-rows", str(t)) for t in (before, after, without)] == [False, True, True]
    assert registry.applies("apex", str(before)), "a shim without a rule always applies"


def test_te_norm_is_listed_for_t5_where_its_local_specs_take_the_final_norm_from_tenorm(tmp_path):
    """core 0.13 on: TENorm is None without TE, and the local T5 blocks are then built without a
    final norm, silently; T5 lists te-norm up front there (and in core 0.9, where it is a NameError)."""
    from megaport.train.families import registry as families

    spec = tmp_path / "megatron/core/models/T5/t5_spec.py"
    spec.parent.mkdir(parents=True)
    spec.write_text("def get_t5_encoder_with_local_block_spec(n):\n"
                    "    return TransformerBlockSubmodules([layer_spec] * n, layer_norm=TENorm)\n")
    assert registry.applies("te-norm", str(tmp_path))
    assert "te-norm" in families.get("t5").baseline_shims
    spec.write_text("# the legacy T5: megatron/model/t5_model.py\n")
    assert not registry.applies("te-norm", str(tmp_path))
    assert not registry.applies("te-norm", str(tmp_path / "nowhere"))


def test_the_trusting_load_shim_reads_a_megatron_checkpoint_where_the_call_says_nothing(tmp_path, monkeypatch):
    """What core 0.6's load_checkpoint meets on torch >= 2.6 (its Namespace), read with the shim;
    a call that asks for weights only still gets them (the shim is torch's own switch)."""
    import argparse
    import pickle

    import torch

    from megaport.train.shims import torch_load_trusting

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(lr=3e-3), "model": {"w": torch.ones(2)}}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    monkeypatch.delenv(torch_load_trusting.SWITCH, raising=False)
    torch_load_trusting.install()
    monkeypatch.setenv(torch_load_trusting.SWITCH, os.environ[torch_load_trusting.SWITCH])  # undone after the test
    assert torch.load(path)["args"].lr == 3e-3
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


def test_an_unported_run_that_loads_starts_trusting_its_own_pickles_where_the_era_needs_it(tmp_path, monkeypatch):
    """Core 0.5 prints a refused ``torch.load`` and exits (no exception to answer): an unported run that
    loads a checkpoint lists torch-load-trusting up front where the era's loads say nothing of
    ``weights_only``; a run that loads nothing, or an era that says it, does not."""
    from megaport.train import baseline, pretrain
    from megaport.train.shims import torch_load_trusting

    old, fixed = tmp_path / "old", tmp_path / "fixed"
    for tree, call in ((old, "torch.load(name, map_location='cpu')"),
                       (fixed, "torch.load(name, map_location='cpu', weights_only=False)")):
        (tree / "megatron").mkdir(parents=True)
        (tree / "megatron" / "checkpointing.py").write_text(f"    state_dict = {call}\n")
    assert torch_load_trusting.applies(str(old)) and not torch_load_trusting.applies(str(fixed))
    assert not torch_load_trusting.applies(str(tmp_path))
    started = []

    @contextlib.contextmanager
    def unported(tree, sha):
        yield tree, {}

    monkeypatch.setattr(baseline, "unported_upstream", unported)
    monkeypatch.setattr(baseline, "with_fewest_shims", lambda go, env, first: started.append(first) or ({}, first))
    for tree in (old, fixed):
        for load in ("/ck", None):
            baseline.run_unported(pretrain.Run(tree=str(tree), family="gpt", load=load), "0" * 40, also=("apex",))
    resuming = pretrain.Run(tree=str(old), family="gpt", extra=((("--load", "/ck"), "resumes"),))  # the resume check's
    baseline.run_unported(resuming, "0" * 40, also=("apex",))
    assert started == [["apex", "torch-load-trusting"], ["apex"], ["apex"], ["apex"], ["apex", "torch-load-trusting"]]


def test_overlap_gather_save_finishes_the_gather_before_the_save_in_its_window(tmp_path):
    """main 2023-11-17 … 2024-05-04: the checkpoint held the other ranks' weights one step old (the
    ported tree resuming it: 20 % in grad norm at its first iteration); upstream's ac08742c96 finished
    the gather first."""
    import types

    from megaport.train.shims import overlap_gather_save

    def tree(name, training):
        root = tmp_path / name
        (root / "megatron" / "optimizer").mkdir(parents=True)
        (root / "megatron" / "optimizer" / "distrib_optimizer.py").write_text("    def disable_pre_hook(self):\n")
        (root / "megatron" / "training.py").write_text(training)
        return str(root)

    window = tree("window", "def save_checkpoint_and_time(iteration, model, optimizer):\n    save_checkpoint()\n\n\n"
                            "def evaluate(optimizer):\n    optimizer.disable_pre_hook()\n")  # 2024-02's loop has both
    fixed = tree("fixed", "def save_checkpoint_and_time(iteration, model, optimizer):\n"
                          "    optimizer.disable_pre_hook()\n")
    assert overlap_gather_save.applies(window) and not overlap_gather_save.applies(fixed)
    assert not overlap_gather_save.applies(str(tmp_path))
    calls = []
    optimizer = types.SimpleNamespace(disable_pre_hook=lambda: calls.append("gathered"),
                                      enable_pre_hook=lambda: calls.append("hooked again"))
    for overlap in (True, False):
        module = types.SimpleNamespace(
            get_args=lambda overlap=overlap: types.SimpleNamespace(use_distributed_optimizer=True,
                                                                   overlap_param_gather=overlap),
            save_checkpoint_and_time=lambda iteration, model, optimizer: calls.append(f"saved {iteration}"))
        overlap_gather_save._gathered_first(module)
        module.save_checkpoint_and_time(15, None, optimizer)
    assert calls == ["gathered", "saved 15", "hooked again", "saved 15"]


def test_the_stack_shim_gives_2023s_distributed_optimizer_its_storage_view():
    """Unported main 2022-09-30 … 2023-12-01 (and Stanford's fork) views its grad buffers' bytes with
    ``torch.tensor(buffer.storage()._untyped(), dtype=params_dtype)``, a name torch 2.0 renamed: the
    shim gives it back, the same bytes seen in the parameters' dtype, in a process of its own."""
    code = ("from megaport.train.shims import stack_names\nstack_names.install()\nimport torch\n"
            "grad = torch.zeros(8)\nview = torch.tensor(grad.storage()._untyped(), dtype=torch.float16)\n"
            "view.fill_(1.0)\nprint(view.numel(), view.data_ptr() == grad.data_ptr(), bool(grad.abs().sum() > 0))")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["16", "True", "True"], done.stderr[-2000:]


def test_dcp_write_item_answers_the_writer_of_core_0_5_to_0_12_and_writes_with_todays_torch():
    """Unported core 0.10-0.12 (c45e651854) saving at DP2 for the cross-load check: its async writer
    called torch's _write_item without the serialization format, and the save died ("Worker
    failure"). With the shim the old call writes the tensor through today's torch."""
    import io
    import types

    import torch
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from megaport.train.shims import dcp_write_item

    died = failure.Failure("RuntimeError", "Worker failure: _write_item() missing 1 required positional argument: "
                           "'serialization_format'", (failure.Frame(
                               "/tmp/u/megatron/core/dist_checkpointing/strategies/filesystem_async.py", 371,
                               "write_preloaded_data_multiproc", "raise RuntimeError(...)"),))
    assert registry.pick([died], have=()) == "dcp-write-item"
    tensor = torch.arange(4.0)
    item = WriteItem(index=MetadataIndex("w"), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=tensor.size()),
                                                 properties=TensorProperties.create_from_tensor(tensor), size=tensor.size()))
    module = types.SimpleNamespace(_write_item=filesystem._write_item)
    stream = io.BytesIO()
    with pytest.raises(TypeError, match="missing"):
        module._write_item(stream, tensor, item, "__0_0.distcp")  # core 0.5's call on today's torch
    dcp_write_item.bound_to_todays_torch(module)
    stream = io.BytesIO()
    result = module._write_item(stream, tensor, item, "__0_0.distcp")
    assert result.storage_data.relative_path == "__0_0.distcp" and result.size_in_bytes == len(stream.getvalue()) > 0
    stream.seek(0)
    assert torch.equal(torch.load(stream, weights_only=True), tensor)
    stream = io.BytesIO()  # core 0.11-0.12's call: the transforms given, the format not
    module._write_item(filesystem._StorageWriterTransforms(), stream, tensor, item, "__1_0.distcp")
    stream.seek(0)
    assert torch.equal(torch.load(stream, weights_only=True), tensor)
