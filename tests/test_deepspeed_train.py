"""The Megatron-DeepSpeed training plumbing, on a synthetic fork tree (no clone, no DeepSpeed run).

The fork's example script becomes the run's flags and DeepSpeed config, changed in size only and
with ZeRO stage 1; fork trees run with DeepSpeed's GPU accelerator; a run DeepSpeed's engine
refuses is told apart from a failure of the tree; the baseline finds its fork shims by the
failures they answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaport import deepspeed_fork
from megaport.smoke import _fork
from megaport.train import deepspeed_example, example, pretrain
from megaport.train.failure import Failure, Frame
from megaport.train.shims import registry

SCRIPT = """#!/bin/bash
set -ex
BASE_PATH=/vc_data/Megatron-LM/data
DATA_PATH=${BASE_PATH}/indexed_datasets/megatron
DS_CONFIG=ds_config.json
TP=1
NLAYERS=24
HIDDEN=512
GLOBAL_BATCH=64
MICRO_BATCH=4
ZERO_STAGE=2
OUTPUT_DIR=ds_z${ZERO_STAGE}_nl${NLAYERS}
cat <<EOT > $DS_CONFIG
{
  "train_batch_size" : $GLOBAL_BATCH,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH,
  "steps_per_print": 1,
  "zero_optimization": { "stage": $ZERO_STAGE },
  "fp16": { "enabled": true, "initial_scale_power": 12 },
  "wall_clock_breakdown" : true
}
EOT
ds_args=""
ds_args=" --deepspeed ${ds_args}"
ds_args=" --no-pipeline-parallel ${ds_args}"
ds_args=" --deepspeed_config=$DS_CONFIG ${ds_args}"
ds_args=" --zero-stage=$ZERO_STAGE ${ds_args}"
deepspeed pretrain_gpt.py \\
    --tensor-model-parallel-size $TP \\
    --num-layers $NLAYERS \\
    --hidden-size $HIDDEN \\
    --num-attention-heads 16 \\
    --seq-length 256 \\
    --micro-batch-size 4 \\
    --global-batch-size 1024 \\
    --train-iters 1000 \\
    --lr 6.0e-5 \\
    --data-path $DATA_PATH \\
    --tensorboard-dir $OUTPUT_DIR \\
    --fp16 \\
    $ds_args \\
    --exit-interval 5000 | tee ${OUTPUT_DIR}/output.log
"""


def fork_tree(root: Path, layout: str = "examples_deepspeed") -> Path:
    (root / layout).mkdir(parents=True)
    (root / layout / "run_deepspeed_example.sh").write_text(SCRIPT)
    (root / "pretrain_gpt.py").write_text("import torch\nimport deepspeed\nfrom megatron import get_args\n")
    return root


def test_fork_example_is_the_script_shrunk_with_zero_stage_1(tmp_path):
    tree = fork_tree(tmp_path / "tree")
    sizes = example.Sizes()
    fork = deepspeed_example.fork_example(str(tree), str(tmp_path), sizes)
    assert fork.source == "examples_deepspeed/run_deepspeed_example.sh"
    flags = example.shrunk(fork.tokens, sizes, data=["DATA"])
    assert flags[:4] == ["--tensor-model-parallel-size", "1", "--num-layers", "2"]
    assert "--hidden-size" in flags and flags[flags.index("--hidden-size") + 1] == "64"
    assert "--fp16" in flags and "--exit-interval" in flags
    assert "|" not in flags and "tee" not in flags and "--data-path" not in flags  # I/O replaced
    config_file = str(tmp_path / "ds_config.json")
    assert fork.deepspeed == ["--zero-stage", "1", "--deepspeed_config", config_file, "--no-pipeline-parallel",
                              "--deepspeed"]
    written = json.loads(Path(config_file).read_text())
    assert written["zero_optimization"] == {"stage": 1}
    assert written["train_batch_size"] == written["train_micro_batch_size_per_gpu"] == sizes.batch
    assert written["fp16"] == {"enabled": True, "initial_scale_power": 12}  # the script's, kept


def test_a_layouts_micro_batch_and_pipeline_stages_reach_deepspeeds_engine(tmp_path):
    tree = fork_tree(tmp_path / "tree")
    sizes = example.Sizes(batch=2)
    fork = deepspeed_example.fork_example(str(tree), str(tmp_path), sizes, micro_batch=1, pipeline=True)
    written = json.loads((tmp_path / "ds_config.json").read_text())
    assert written["train_batch_size"] == 2 and written["train_micro_batch_size_per_gpu"] == 1
    assert "--no-pipeline-parallel" not in fork.deepspeed and "--deepspeed" in fork.deepspeed
    assert any("--no-pipeline-parallel left out" in note for note in fork.notes)


def test_a_run_leaving_fp16_out_turns_the_deepspeed_configs_fp16_off_too(tmp_path):
    tree = fork_tree(tmp_path / "tree")
    fork = deepspeed_example.fork_example(str(tree), str(tmp_path), example.Sizes(),
                                          left_out={"--fp16": "compared in fp32"})
    assert "--fp16" not in fork.tokens and "--exit-interval" in fork.tokens
    assert "--fp16 left out (compared in fp32)" in fork.notes
    written = json.loads((tmp_path / "ds_config.json").read_text())
    assert written["fp16"] == {"enabled": False, "initial_scale_power": 12}  # else DeepSpeed halves the model


def test_the_forks_gpt_layouts_are_compared_in_fp32_and_upstreams_are_not(tmp_path):
    from megaport.train.families import registry

    gpt = registry.get("gpt")
    assert [flag for flag, _ in gpt.layout_left_out(str(fork_tree(tmp_path / "fork")))] == ["--fp16"]
    upstream = tmp_path / "up"
    upstream.mkdir()
    (upstream / "pretrain_gpt.py").write_text("import torch\nfrom megatron import get_args\n")
    assert gpt.layout_left_out(str(upstream)) == ()
    cmd = pretrain.command(pretrain.Run(tree=str(fork_tree(tmp_path / "f2")), left_out=gpt.layout_left_out(
        str(tmp_path / "fork"))), str(tmp_path), port=29500)
    assert "--fp16" not in cmd.argv


def test_megatron_engine_leaves_the_deepspeed_flags_out(tmp_path):
    tree = fork_tree(tmp_path / "tree", layout="examples")
    fork = deepspeed_example.fork_example(str(tree), str(tmp_path), example.Sizes(), engine="megatron")
    assert fork.source == "examples/run_deepspeed_example.sh"
    assert fork.deepspeed == [] and not (tmp_path / "ds_config.json").exists()
    assert deepspeed_example.DESCRIBE["megatron"] in fork.notes


def test_upstream_tree_is_not_a_fork(tmp_path):
    tree = tmp_path / "up"
    (tree / "examples").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("import torch\nfrom megatron import get_args\n")
    (tree / "examples/run_deepspeed_example.sh").write_text(SCRIPT)
    assert deepspeed_example.fork_example(str(tree), str(tmp_path), example.Sizes()) is None
    assert deepspeed_fork.accelerator_env(tree, {}) == {}


def test_fork_trees_run_with_deepspeeds_gpu_accelerator_unless_the_user_chose(tmp_path):
    tree = fork_tree(tmp_path / "tree")
    assert deepspeed_fork.accelerator_env(tree, {})[deepspeed_fork.ACCELERATOR_ENV] == "cuda"
    assert deepspeed_fork.accelerator_env(tree, {deepspeed_fork.ACCELERATOR_ENV: "cpu"})[deepspeed_fork.ACCELERATOR_ENV] == "cpu"
    assert pretrain.environment(str(tree), {})[deepspeed_fork.ACCELERATOR_ENV] == "cuda"


def test_the_command_carries_the_fork_example_and_its_deepspeed_flags(tmp_path):
    tree = fork_tree(tmp_path / "tree")
    cmd = pretrain.command(pretrain.Run(tree=str(tree)), str(tmp_path), port=29500)
    argv = cmd.argv[cmd.argv.index("pretrain_gpt.py") + 1:]
    assert argv[-1] == "--deepspeed" and "--zero-stage" in argv
    assert any("run_deepspeed_example.sh" in note for note in cmd.notes)


def test_engine_refusal_is_told_apart_from_a_failure_of_the_tree():
    refused = ('pretrain_gpt.py failed (exit code 1): ValueError: Type fp16 is not supported on your device.\n'
               '  File ".../deepspeed/runtime/engine.py", line 2004, in _do_sanity_check')
    assert deepspeed_example.engine_refused(refused).startswith("ValueError: Type fp16 is not supported on your device.")
    # The fork's 2023-07 train() taking optimizer.scale_loss is its own bug, served by the series
    # and the baseline's shim, never a reason to leave DeepSpeed's engine.
    merge = "AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'scale_loss'. Did you mean"
    assert deepspeed_example.engine_refused(merge) is None
    assert registry.pick([_failure(merge)], []) == "fork-deepspeed-train"
    assert deepspeed_example.engine_refused("ImportError: cannot import name 'x' (engine.py)") is None
    assert deepspeed_example.engine_refused("AttributeError: 'Namespace' object has no attribute 'scale_loss'") is None


def test_baseline_finds_the_fork_shims_by_their_failures():
    missing = Failure("ModuleNotFoundError", "No module named 'deepspeed.compression.compress'",
                      module="deepspeed.compression.compress")
    assert registry.pick([missing], []) == "deepspeed-compression"
    view = Failure("RuntimeError", "view size is not compatible with input tensor's size and stride (at least one "
                   "dimension", (Frame("/tmp/u/megatron/model/transformer.py", 301, "forward",
                                       "query_layer = query_layer.view(output_size[2],"),))
    assert registry.pick([view], []) == "fork-attention-view"
    assert registry.pick([view], ["fork-attention-view"]) is None


# What the unported fork at its 2023-07-04 merge (9e72d571) prints, in the order its run meets them.
MERGE_FAILURES = [
    ("AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'scale_loss'. Did you mean: 'scale_if_loss'?",
     "fork-deepspeed-train"),
    ("AttributeError: 'dict' object has no attribute 'no_sync_func'", "fork-deepspeed-train"),
    ("AttributeError: module 'megatron.core.parallel_state' has no attribute "
     "'reset_checkpointed_activations_memory_buffer'", "fork-legacy-mpu"),
    ("AttributeError: 'Timers' object has no attribute 'timers'. Did you mean: '_timers'?", "fork-deepspeed-train"),
]


def test_baseline_finds_the_2023_07_merge_shims_by_their_failures():
    for text, shim in MERGE_FAILURES:
        assert registry.pick([_failure(text)], []) == shim, text
        assert registry.pick([_failure(text)], [shim]) is None, text
    assert registry.pick([_failure("AttributeError: 'Namespace' object has no attribute 'scale_loss'")], []) is None


def _failure(text: str) -> Failure:
    """'Type: message', as the exception would be recorded."""
    kind, message = text.split(": ", 1)
    return Failure(kind, message)


_FAKE_FORK = {  # the shapes of the 9e72d571 modules the shims step into, and DeepSpeed's ZeRO base
    "deepspeed/__init__.py": "",
    "deepspeed/runtime/__init__.py": "",
    "deepspeed/runtime/base_optimizer.py": "class ZeROOptimizer:\n    pass\n\n\n"
                                           "class DeepSpeedZeroOptimizer(ZeROOptimizer):\n    pass\n",
    "megatron/__init__.py": "import types\n\n_ARGS = types.SimpleNamespace(deepspeed=True)\n\n\n"
                            "def get_args():\n    return _ARGS\n",
    "megatron/timers.py": "class Timers:\n    def __init__(self):\n        self._timers = {'a': 1}\n",
    "megatron/core/__init__.py": "import megatron.core.parallel_state\nimport megatron.core.tensor_parallel\n"
                                 "import megatron.core.utils\n\nmpu = parallel_state\n",
    # initialize.py makes parallel_state's checkpoint DeepSpeed's (function, *args) under
    # --deepspeed-activation-checkpointing.
    "megatron/core/parallel_state.py": "def checkpoint(function, *args):\n    return function(*args)\n\n\n"
                                       "def world_size():\n    return 1\n",
    "megatron/core/tensor_parallel.py": "def reset_checkpointed_activations_memory_buffer():\n    return 'reset'\n\n\n"
                                        "def checkpoint(function, distribute_saved_activations, *args):\n"
                                        "    return function(*args)\n",
    "megatron/model/__init__.py": "from . import transformer\n",
    "megatron/model/transformer.py": "from megatron.core import mpu, tensor_parallel\n\n\n"
                                     "def recompute(function, x):\n"
                                     "    mpu.reset_checkpointed_activations_memory_buffer()\n"
                                     "    return mpu.checkpoint(function, False, x), mpu.world_size()\n",
    "megatron/core/utils.py": "def get_attr_wrapped_model(model, attr, allow_none=True):\n"
                              "    while getattr(model, attr, None) is None:\n        model = model.module\n"
                              "    return getattr(model, attr)\n\n\n"
                              "def get_model_config(model):\n"
                              "    return get_attr_wrapped_model(model, 'config', allow_none=False)\n",
}
_CHECK = """
import types
from deepspeed.runtime.base_optimizer import DeepSpeedZeroOptimizer
from megatron.core import mpu, utils
from megatron.timers import Timers

assert DeepSpeedZeroOptimizer().scale_loss is None  # so train() leaves grad_scale_func None
engine = types.SimpleNamespace(config={"train_batch_size": 2}, module=types.SimpleNamespace(config="transformer"))
assert utils.get_model_config(engine) == "transformer"
assert Timers().timers == {"a": 1}
from megatron.model import transformer

assert transformer.recompute(lambda x: x + 1, 1) == (2, 1)  # tensor_parallel's checkpoint; parallel_state's others
assert mpu.checkpoint(lambda x: x, 3) == 3  # parallel_state itself unchanged
print("ok")
"""


def test_the_2023_07_merge_shims_serve_the_forks_own_fixes(tmp_path):
    import os
    import subprocess
    import sys

    for rel, text in _FAKE_FORK.items():
        (tmp_path / "tree" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / rel).write_text(text)
    src = str(Path(registry.__file__).parents[3])
    env = registry.environment({"PYTHONPATH": os.pathsep.join([str(tmp_path / "tree"), src])},
                               ["fork-deepspeed-train", "fork-legacy-mpu"])
    env["PATH"] = os.environ.get("PATH", "")
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_fused_wgrad_is_seen_only_in_live_code():
    import types

    live = types.ModuleType("live")
    commented = types.ModuleType("commented")
    assert _fork.fuses_wgrad(live)  # no source: assume the era fuses
    # inspect reads the module's file: write two small ones
    import importlib.util
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for name, body in (("live", "def f(g):\n    g.wgrad_gemm_accum_fp32(1)\n"),
                           ("commented", "def f(g):\n    # g.wgrad_gemm_accum_fp32(1)\n    return 0\n")):
            path = Path(folder) / f"{name}.py"
            path.write_text(body)
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if name == "live":
                live = module
            else:
                commented = module
        assert _fork.fuses_wgrad(live) and not _fork.fuses_wgrad(commented)


def _one_rank_comparison(tmp_path, monkeypatch, tree: Path, apart: float) -> dict:
    """one_rank.compare of GPT in tp2-sp with both runs faked, the layout's losses ``apart`` from one rank's."""
    from megaport.train.checks import one_rank
    from megaport.train.checks.spec import Context
    from megaport.train.layouts import registry as layouts

    own = [6.0 * (1 - 0.01 * i) for i in range(30)]

    def layout_run(context, family, layout, sized_for=None):
        losses = own if layout is layouts.ONE_RANK else [v * (1 + apart) for v in own]
        return pretrain.Run(tree=context.tree), {"iterations": list(range(1, 31)), "losses": losses,
                                                 "grad_norms": [None] * 30}

    monkeypatch.setattr(one_rank, "layout_run", layout_run)
    monkeypatch.setattr(one_rank, "shared_start", lambda context, run: one_rank.Start(load="ckpt"))
    return one_rank.compare(Context(str(tree), None, False, {}, str(tmp_path)), "gpt", layouts.get("tp2-sp"))


def test_the_forks_fp32_layouts_fail_a_fault_that_fp16s_tolerance_would_pass(tmp_path, monkeypatch):
    """The fork's SP position shard left out of the grad-norm clip was 9.6e-4 from one rank in fp32
    (the fixed run 3.6e-7): fp32 runs of a dense model are held to 1e-4, fp16 runs to 1 %."""
    fork = fork_tree(tmp_path / "fork")
    assert _one_rank_comparison(tmp_path, monkeypatch, fork, 3.6e-7)["problems"] == []
    compared = _one_rank_comparison(tmp_path, monkeypatch, fork, 9.6e-4)
    assert len(compared["problems"]) == 1 and "losses differ by up to 0.10%" in compared["problems"][0]
    assert "tolerance 1e-04: fp32 on both sides" in compared["problems"][0]
    assert compared["tolerance"]["loss"] == 1e-4
    upstream = tmp_path / "up"
    upstream.mkdir()
    (upstream / "pretrain_gpt.py").write_text("import torch\nfrom megatron import get_args\n")
    compared = _one_rank_comparison(tmp_path, monkeypatch, upstream, 9.6e-4)  # fp16: within its rounding
    assert compared["problems"] == [] and "tolerance" not in compared
