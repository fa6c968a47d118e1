"""The training runner (megaport.train) on the CPU: the example flags read from each shape of
upstream's scripts and shrunk, the tiny indexed dataset read back by upstream's own reader,
upstream's log format, the torchrun launch with the CPU substitutions, and the loss-parity
baseline's shims (with stand-in pretrain_gpt.py scripts; the real trees are run by
test_train_fullclone.py and by verify's smoke suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaport.train import data, example, failure, log, pretrain
from megaport.train.preloaded import protocol as preloaded, servers
from megaport.train.shims import registry
# The three shapes upstream's example scripts have had (abridged): arrays (2024 on), quoted
# strings (2022-2023), one command line (2020-2021).
ARRAYS = """#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
CHECKPOINT_PATH=$1 #<Specify path>
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --master_port $MASTER_PORT
)
GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --seq-length 2048
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --rampup-batch-size 16 16 5859375
    --fp16
    --lr 6.0e-5
)
DATA_ARGS=(
    --data-path $DATA_PATH
    --split 949,50,1
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DATA_ARGS[@]}
"""
STRINGS = """#!/bin/bash
GPT_ARGS="
    --num-layers 24 \\
    --hidden-size 1024 \\
    --lr 0.00015 \\
    --fp16
"
DATA_ARGS="
    --data-path $DATA_PATH \\
    --vocab-file $VOCAB_FILE \\
    --split 949,50,1
"
torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \\
    $GPT_ARGS \\
    $DATA_ARGS \\
    --save $CHECKPOINT_PATH
"""
COMMAND_LINE = """#! /bin/bash
# Runs the "345M" parameter model
RANK=0
DATA_PATH=<Specify path and file prefix>_text_sentence
python pretrain_gpt.py \\
       --num-layers 24 \\
       --hidden-size 1024 \\
       --data-path $DATA_PATH \\
       --vocab-file gpt2-vocab.json \\
       --DDP-impl local \\
       --checkpoint-activations \\
       --fp16
"""


SCHEDULE = """#!/bin/bash
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --step-batch-size-schedule "0:16 2.4B:320 12B:1536"  # ramp-up by samples
    --lr 6.0e-5
)
"""
ONE_LINE_STRING = 'GPT_ARGS="--num-layers 24 --hidden-size 1024 --fp16"\n'


@pytest.mark.parametrize("text,flags", [
    (ARRAYS, ["--num-layers", "96", "--hidden-size", "12288", "--seq-length", "2048", "--micro-batch-size", "1",
              "--rampup-batch-size", "16", "16", "5859375", "--fp16", "--lr", "6.0e-5", "--split", "949,50,1"]),
    (STRINGS, ["--num-layers", "24", "--hidden-size", "1024", "--lr", "0.00015", "--fp16", "--split", "949,50,1"]),
    (COMMAND_LINE, ["--num-layers", "24", "--hidden-size", "1024", "--vocab-file", "gpt2-vocab.json",
                    "--DDP-impl", "local", "--checkpoint-activations", "--fp16"]),
    (SCHEDULE, ["--micro-batch-size", "1", "--global-batch-size", "1536", "--step-batch-size-schedule",
                "0:16 2.4B:320 12B:1536", "--lr", "6.0e-5"]),
    (ONE_LINE_STRING, ["--num-layers", "24", "--hidden-size", "1024", "--fp16"]),
], ids=["arrays", "strings", "command-line", "quoted-value", "one-line-string"])
def test_example_flags_are_read_from_every_script_shape(text, flags):
    assert example.script_flags(text) == flags


def test_shrinking_changes_sizes_iterations_and_io_only():
    sizes = example.Sizes(layers=2, hidden=64, heads=4, seq=128, batch=2, steps=5)
    flags = example.shrunk(example.script_flags(ARRAYS), sizes, data=["--mock-data"])
    assert flags[:6] == ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "128"]
    assert "--fp16" in flags and "--rampup-batch-size" not in flags and "--data-path" not in flags
    assert flags[flags.index("--lr") + 1] == "6.0e-5"  # the example's learning rate, not ours
    assert flags.count("--split") == 0 and "--mock-data" in flags and "--seed" not in flags


@pytest.mark.parametrize("source", [["--mock-data"], ["--train-data-path", "t", "--valid-data-path", "v"]])
def test_the_scripts_data_source_gives_way_to_the_runs(source):
    """Llama 3's script passes --mock-data as well as --data-path (both branches of its data
    conditional): beside the run's indexed data upstream refused two sources (core 0.13's oldest commit)."""
    flags = example.shrunk(["--fp16", *source, "--data-path", "$DATA"], example.Sizes(), data=["--data-path", "run"])
    assert flags == ["--fp16", "--data-path", "run"]


def test_a_step_schedule_is_shrunk_and_kept_without_the_global_batch_it_excludes():
    notes: list = []
    flags = example.shrunk(example.script_flags(SCHEDULE), example.Sizes(batch=2), data=[], notes=notes)
    assert flags[flags.index("--step-batch-size-schedule") + 1] == "0:2"
    assert "--global-batch-size" not in flags and any("refuses both" in n for n in notes)


def test_a_flag_upstream_renamed_takes_the_name_the_eras_parser_knows(tmp_path):
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron/arguments.py").write_text("group.add_argument('--recompute-method', type=str)\n")
    notes: list = []
    flags = example.shrunk(["--activations-checkpoint-method", "uniform", "--fp16"], example.Sizes(), data=[],
                           tree=str(tmp_path), notes=notes)
    assert flags == ["--recompute-method", "uniform", "--fp16"] and "renamed" in notes[0]


def test_fusions_off_flags_are_those_the_eras_parser_has(tmp_path):
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron/arguments.py").write_text(
        "add('--no-masked-softmax-fusion'); add('--no-bias-dropout-fusion'); add('--transformer-impl')\n")
    assert example.fusions_off_flags(str(tmp_path)) == ["--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
                                                         "--transformer-impl", "local"]


def test_v2_0s_parser_turns_its_softmax_fusion_off_by_its_own_name(tmp_path):
    """v2.0 (2021-01-12) named the flag --no-scaled-masked-softmax-fusion: without it the unported
    run asked for the CUDA softmax kernel it has not built (ModuleNotFoundError)."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron/arguments.py").write_text(
        "group.add_argument('--no-scaled-masked-softmax-fusion', action='store_false')\n")
    assert example.fusions_off_flags(str(tmp_path)) == ["--no-scaled-masked-softmax-fusion"]


def test_the_unported_side_keeps_upstreams_bias_gelu_fusion(tmp_path):
    """Upstream's fused bias-GeLU is its own torch.jit code (a ROCm user keeps it) and the tanh
    approximation of GELU; its unfused path is the exact GELU. Turned off on the unported side
    only, parity would compare two functions, not the port."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron/arguments.py").write_text(
        "".join(f"add('{flag}')\n" for flag in example.FUSIONS_OFF_FLAGS + ["--no-bias-gelu-fusion"]))
    flags = example.fusions_off_flags(str(tmp_path))
    assert "--no-masked-softmax-fusion" in flags and "--no-bias-gelu-fusion" not in flags


def test_the_tiny_dataset_reads_back_through_upstreams_reader(core_upstream, tmp_path):
    docs = data.learnable_documents(12, 40, 257, seed=3)
    prefix = str(tmp_path / "tiny_text_document")
    data.write_indexed_dataset(prefix, docs)
    for version in ("0.5.0", "0.16.1"):
        tree = tmp_path / version
        tree.mkdir()
        archive = subprocess.run(["git", "archive", f"core_v{version}", "megatron/core"], cwd=core_upstream,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        code = (f"import sys, json; sys.path.insert(0, {str(tree)!r})\n"
                "from megatron.core.datasets import indexed_dataset as m\n"
                "reader = getattr(m, 'IndexedDataset', None) or m.MMapIndexedDataset  # the name before 0.6\n"
                f"ds = reader({prefix!r})\n"
                "docs = getattr(ds, 'document_indices', None)\n"
                "docs = ds.doc_idx if docs is None else docs\n"
                "print(json.dumps([len(ds), [ds[i].tolist() for i in range(len(ds))], docs.tolist()]))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        count, read, documents = json.loads(proc.stdout.splitlines()[-1])
        assert count == 12 and read == docs and documents == list(range(13)), version
        assert all(doc[-1] == 256 for doc in read)  # each document ends with the end-of-document id


def test_the_vocabulary_covers_every_byte_and_the_end_of_document_token(tmp_path):
    vocab_file, merges_file = data.write_gpt2_vocabulary(str(tmp_path))
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    assert len(vocab) == 257 and vocab[data.EOD] == 256
    assert sorted(vocab.values()) == list(range(257))
    assert vocab["A"] == ord("A") - ord("!") and chr(256) in vocab  # printable bytes as themselves
    assert Path(merges_file).read_text() == "#version: 0.2\n"


LOG = """\
 [2025-01-01 00:00:01] iteration        1/      30 | consumed samples:            2 | elapsed time per iteration (ms): 900.5 | learning rate: 1.000000E-03 | global batch size:     2 | loss scale: 4294967296.0 | number of skipped iterations:   1 | number of nan iterations:   0 |
 [2025-01-01 00:00:02] iteration        2/      30 | consumed samples:            4 | elapsed time per iteration (ms): 41.2 | learning rate: 1.000000E-03 | global batch size:     2 | lm loss: 5.612345E+00 | loss scale: 2147483648.0 | grad norm: 3.210 | number of skipped iterations:   0 | number of nan iterations:   0 |
 iteration        3/      30 | consumed samples:            6 | elapsed time per iteration (ms): 40.8 | learning rate: 1.000000E-03 | global batch size:     2 | lm loss: 5.101000E+00 | loss scale: 2147483648.0 |
"""


def test_upstreams_log_lines_give_loss_and_time_per_iteration():
    found = log.parse_log(LOG + "unrelated line with iteration 9\n")
    assert [(i.iteration, i.loss, i.ms) for i in found] == [(2, 5.612345, 41.2), (3, 5.101, 40.8)]


def test_a_skipped_iteration_logged_with_a_zero_loss_is_no_loss():
    """Upstream main prints 'lm loss: 0.000000E+00' for an iteration fp16's loss scaler skipped."""
    skipped = (" iteration        4/      30 | elapsed time per iteration (ms): 39.0 | lm loss: 0.000000E+00 |"
               " loss scale: 1073741824.0 | number of skipped iterations:   1 | number of nan iterations:   0 |\n")
    advanced = skipped.replace("iteration        4/", "iteration        5/").replace(
        "lm loss: 0.000000E+00", "lm loss: 5.000000E+00").replace("skipped iterations:   1", "skipped iterations:   0")
    found = log.parse_log(LOG + skipped + advanced)
    assert [i.iteration for i in found] == [2, 3, 5]


def fake_tree(tmp_path: Path, exit_code: int = 0) -> Path:
    """A tree whose pretrain_gpt.py prints upstream's log lines for the iterations it is asked
    for, with a falling loss, after checking it got the flags a user's run would give it and
    touching the CUDA plumbing upstream's loop touches (which the CPU substitutions must serve)."""
    tree = tmp_path / "tree"
    (tree / "megatron/training").mkdir(parents=True)
    (tree / "megatron/training/arguments.py").write_text(
        "group.add_argument('--mock-data', action='store_true'); add('--no-masked-softmax-fusion')\n")
    (tree / "pretrain_gpt.py").write_text(f"""
import os, sys
import torch
args = sys.argv[1:]
assert os.environ["LOCAL_RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"  # started by torchrun
assert "--mock-data" in args and "--fp16" in args, args
assert torch.cuda.is_available() and torch.cuda.device_count() == 1
torch.cuda.set_device(0)
torch.distributed.init_process_group(backend="nccl")
x = torch.ones(4, device=torch.cuda.current_device()).cuda() + torch.cuda.FloatTensor([1.0]).to("cuda")
torch.distributed.all_reduce(x)
torch.cuda.manual_seed(7)
state = torch.cuda.get_rng_state()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); torch.cuda.synchronize(); end.record()
assert start.elapsed_time(end) >= 0 and x.type() == "torch.cuda.FloatTensor" and x.tolist() == [2.0] * 4
steps = int(args[args.index("--train-iters") + 1])
for it in range(1, steps + 1):
    print(f" iteration {{it:8d}}/{{steps:8d}} | elapsed time per iteration (ms): {{100 + it}}.0 | lm loss: {{10.0 / it:E}} |")
if {exit_code}:
    print("RuntimeError: the rank's own reason", file=sys.stderr)
sys.exit({exit_code})
""")
    return tree


def test_run_pretrain_launches_torchrun_with_the_cpu_substitutions_and_reads_the_log(tmp_path):
    tree = fake_tree(tmp_path)
    run = pretrain.Run(tree=str(tree), sizes=example.Sizes(steps=8), warmup=2)
    result = pretrain.run_pretrain(run)
    assert result["iterations"] == list(range(1, 9)) and result["losses"][-1] == pytest.approx(10 / 8)
    assert result["ms_per_iter"] == 105.5  # median of iterations 3..8
    assert "torch.distributed.run" in result["command"] and "megaport.train.launch --cpu pretrain_gpt.py" in result["command"]
    assert result["data"] == "mock data, NullTokenizer"
    assert any(s.startswith("process group") for s in result["substitutions"])
    assert result["peak_memory_kind"] == "process max RSS" and result["peak_memory_bytes"] > 2**20
    again = pretrain.run_pretrain(run)  # torchrun and the rank forked from the imports the first run's server did
    assert [f"{name}: forked from the preloaded imports" in " ".join(again["started"]) for name in ("torchrun", "rank")] \
        == [True, True], again["started"]
    assert again["losses"] == result["losses"] and again["substitutions"] == result["substitutions"]


@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked"])
@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_cpu_rank_ends_without_teardown_but_loses_nothing(tmp_path, exit_code, forked):
    """A CPU rank exits without the interpreter's teardown, yet what a normal exit finishes is
    finished: a writer thread still running (an async checkpoint's) and the atexit functions,
    and the script's exit code is the process's."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(f"""
import atexit, sys, threading, time
def write_late():
    time.sleep(1.0)
    open({str(tmp_path / "thread")!r}, "w").write("written")
threading.Thread(target=write_late).start()
atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
sys.exit({exit_code})
""")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    env.update(servers.environment_for(str(script), env) if forked else {preloaded.ENV: "0"})
    proc = subprocess.run([sys.executable, "-m", "megaport.train.launch", "--cpu", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == exit_code, proc.stderr[-2000:]
    assert ("rank: forked from the preloaded imports" in proc.stdout) == forked
    assert (tmp_path / "thread").read_text() == "written" and (tmp_path / "atexit").read_text() == "ran"
    assert ("> megaport: peak memory" in proc.stdout) == (exit_code == 0)  # flushed before the exit


def test_a_failing_run_says_why(tmp_path):
    tree = fake_tree(tmp_path, exit_code=3)
    with pytest.raises(RuntimeError, match=r"failed \(exit code 3\) after 4 logged iterations") as failure:
        pretrain.run_pretrain(pretrain.Run(tree=str(tree), sizes=example.Sizes(steps=4)))
    assert "lm loss" in str(failure.value) and "ChildFailedError" not in str(failure.value)


def test_eras_without_mock_data_get_files_the_command_names(tmp_path):
    tree = tmp_path / "old"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron/arguments.py").write_text("group.add_argument('--data-path', nargs='*')\n")
    (tree / "examples").mkdir()
    (tree / "examples/pretrain_gpt.sh").write_text(COMMAND_LINE)
    run = pretrain.Run(tree=str(tree), sizes=example.Sizes(steps=4, seq=32, batch=2))
    cmd = pretrain.command(run, str(tmp_path))
    argv = cmd.argv
    assert argv[argv.index("--tokenizer-type") + 1] == "GPT2BPETokenizer" and "--mock-data" not in argv
    assert Path(argv[argv.index("--data-path") + 1] + ".idx").is_file()
    assert argv[argv.index("--vocab-file") + 1] == str(tmp_path / "vocab.json")  # ours, not the script's
    assert "--DDP-impl" in argv and "--checkpoint-activations" in argv  # the era's feature flags stay
    assert "--legacy-tokenizer" not in argv  # an era without the flag never gets it


def test_eras_with_a_hub_tokenizer_system_read_the_runs_vocabulary_files_offline(tmp_path):
    """Main 2025-09-04 … 2026-02-09 built GPT2BPETokenizer through its new tokenizer system, which
    loads gpt2 from the Hugging Face hub even with --vocab-file: offline, a 2025-09-09 commit's GPT,
    Llama, Mixtral and DeepSeek trained nothing. Its --legacy-tokenizer reads the run's files."""
    tree = tmp_path / "2025-09"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron/arguments.py").write_text("group.add_argument('--data-path', nargs='*')\n"
                                                "group.add_argument('--legacy-tokenizer', action='store_true')\n")
    (tree / "examples").mkdir()
    (tree / "examples/pretrain_gpt.sh").write_text(COMMAND_LINE)
    cmd = pretrain.command(pretrain.Run(tree=str(tree), sizes=example.Sizes(steps=4, seq=32, batch=2)), str(tmp_path))
    assert cmd.argv[cmd.argv.index("--tokenizer-type") + 1] == "GPT2BPETokenizer" and "--legacy-tokenizer" in cmd.argv
    assert any(note.startswith("--legacy-tokenizer (the run's GPT-2 vocabulary") for note in cmd.notes)


def _commit(tree: Path) -> str:
    for args in (["init", "--quiet"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "up"]):
        subprocess.run(["git", *args], cwd=tree, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()


def test_bench_train_runs_both_sides_through_pretrain_gpt(tmp_path):
    """bench --train: the ported tree as it is, and its upstream commit exported next to it with the
    fusions off, each through pretrain_gpt.py under torchrun; the tree is left as it was."""
    from megaport.commands import bench_train

    tree = fake_tree(tmp_path)
    sha = _commit(tree)
    sizes = dict(layers=1, hidden=64, heads=4, seq=32, batch=2, steps=6, warmup=1, vocab=128)
    ported = bench_train._pretrain_side(tree, sha, "ported", {}, sizes, "cpu")
    upstream = bench_train._pretrain_side(tree, sha, "upstream", {}, sizes, "cpu")
    assert ported["losses"] == upstream["losses"] and len(ported["losses"]) == 6
    assert upstream["baseline_shims"] == [] and "unported" in upstream["what"]
    assert "--no-masked-softmax-fusion" in upstream["command"] and "--no-masked-softmax-fusion" not in ported["command"]
    assert bench_train._entry("auto", tree) == "pretrain" and bench_train._entry("auto", tmp_path) == "harness"
    with pytest.raises(Exception, match="has no pretrain_gpt.py"):
        bench_train._entry("pretrain", tmp_path)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tree, capture_output=True, text=True).stdout == ""


def test_print_command_needs_a_megatron_lm_tree(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        pretrain.main(["--tree", str(tmp_path), "--print-command"])
    assert stopped.value.code == 2 and "has no pretrain_gpt.py" in capsys.readouterr().err
    tree = fake_tree(tmp_path)
    assert pretrain.main(["--tree", str(tree), "--device", "cpu", "--print-command", "--workdir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "PYTHONPATH=" in out and "launch --cpu pretrain_gpt.py --num-layers 2" in out


def test_wgrad_shim_lets_2022s_linear_backward_take_a_non_contiguous_gradient(tmp_path):
    """2022-02/05 upstream's backward views its gradient in 2-D; the shim hands it a contiguous one."""
    layers = tmp_path / "tree" / "megatron" / "mpu"
    layers.mkdir(parents=True)
    (layers.parent / "__init__.py").write_text("")
    (layers / "__init__.py").write_text("")
    (layers / "layers.py").write_text(
        "import torch\n\n\nclass LinearWithGradAccumulationAndAsyncAllreduce(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, input, weight):\n"
        "        ctx.save_for_backward(input, weight)\n        return torch.matmul(input, weight.t())\n\n"
        "    @staticmethod\n    def backward(ctx, grad_output):\n        input, weight = ctx.saved_tensors\n"
        "        grad_input = grad_output.matmul(weight)\n"
        "        grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1], grad_output.shape[2])\n"
        "        return grad_input, grad_output.t().matmul(input.reshape(-1, input.shape[2]))\n")
    code = """
import sys, torch
from megaport.train import failure
sys.excepthook = lambda kind, exc, tb: (failure.record(exc), sys.__excepthook__(kind, exc, tb))
from megatron.mpu.layers import LinearWithGradAccumulationAndAsyncAllreduce as Linear
x, w = torch.randn(3, 2, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
# A transpose after the layer: autograd hands its backward a non-contiguous gradient.
Linear.apply(x, w).transpose(0, 1).sum(-1).pow(2).sum().backward()
want = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
(want[0] @ want[1].t()).transpose(0, 1).sum(-1).pow(2).sum().backward()
print(torch.allclose(x.grad, want[0].grad), torch.allclose(w.grad, want[1].grad))
"""
    def run(shims):
        env = registry.environment({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "tree")}, shims)
        env[failure.FAILURE_DIR_ENV] = str(tmp_path)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              cwd=tmp_path / "tree")
    unshimmed = run([])
    assert registry.pick(failure.read(tmp_path), []) == "wgrad-contiguous", unshimmed.stderr[-2000:]
    shimmed = run(["wgrad-contiguous"])
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    assert shimmed.stdout.split() == ["True", "True"]


def test_baseline_shims_serve_what_unported_old_upstream_imports(tmp_path):
    env = registry.environment({"PATH": "/usr/bin:/bin"}, ["stack", "apex", "transformer-engine"])
    code = """
import numpy as np, torch
from torch._six import inf
from apex.optimizers import FusedAdam
from apex.multi_tensor_apply import multi_tensor_applier
import amp_C, fused_mix_prec_layer_norm_cuda
import transformer_engine as te
from importlib.metadata import version
assert version("transformer-engine") == "0.0.0+megaport.stub"
class Linear(te.pytorch.Linear):
    pass
try:
    Linear(8, 8)
except ImportError as exc:
    stub = str(exc)
norm = te.pytorch.LayerNorm(hidden_size=8, eps=1e-5, sequence_parallel=False, params_dtype=torch.float32)
assert torch.allclose(norm(torch.ones(2, 8)), torch.zeros(2, 8))  # the final norm core 0.4-0.7 build
p = torch.nn.Parameter(torch.ones(3))
p.grad = torch.ones(3)
FusedAdam([p], lr=0.1).step()
print(np.float is float, inf == float("inf"), "stub" in stub, torch.allclose(p, torch.full((3,), 0.9)))
# What 2021-2022 upstream imports of apex besides: its LayerNorm module, the persistent layer norm,
# and the wgrad extension under its 2022 name; each computes what torch computes.
from apex.normalization.fused_layer_norm import FusedLayerNorm
from apex.contrib.layer_norm.layer_norm import FastLayerNormFN
import fused_dense_cuda
torch.manual_seed(0)
x, w, b = torch.randn(4, 8), torch.rand(8) + 0.5, torch.randn(8)
want = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
norm = FusedLayerNorm(8, eps=1e-5)
with torch.no_grad():
    norm.weight.copy_(w), norm.bias.copy_(b)
main_grad = torch.zeros(3, 8)
fused_dense_cuda.wgrad_gemm_accum_fp32(x, torch.ones(4, 3), main_grad)
print(torch.allclose(norm(x), want, atol=1e-6), torch.allclose(FastLayerNormFN.apply(x, w, b, 1e-5), want, atol=1e-6),
      torch.allclose(main_grad, torch.ones(4, 3).t() @ x, atol=1e-6))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True"] * 7


def test_a_run_of_several_ranks_names_the_first_rank_to_fail_not_its_peers_closed_connection(tmp_path, monkeypatch):
    """Rank 1 raises; rank 0 then dies of "Connection closed by peer", the log's last error."""
    from megaport.train import failure, log

    monkeypatch.setenv(failure.FAILURE_DIR_ENV, str(tmp_path))
    for name, exc in (("failure-9.json", AssertionError("sequence parallel not supported by torch LayerNorm")),
                      ("failure-1.json", RuntimeError("[pair.cc:534] Connection closed by peer"))):
        failure.record(exc)  # each rank's file is named by its pid, which says nothing of the order
        (tmp_path / f"failure-{os.getpid()}.json").rename(tmp_path / name)
    died_of = failure.read(tmp_path)
    assert [f.exception for f in died_of] == ["AssertionError", "RuntimeError"]  # written first, read first
    stderr = "RuntimeError: [pair.cc:534] Connection closed by peer\n"
    message = log.failure_message(1, "", stderr, 0, first_failure=died_of[0])
    assert message.splitlines()[0].endswith("AssertionError: sequence parallel not supported by torch LayerNorm")
    assert "Connection closed" in log.failure_message(1, "", stderr, 0).splitlines()[0]


def test_a_rank_megaports_guard_stopped_is_named_not_its_peers_closed_connection():
    """Rank 1 found no checkpoint to load and the resume guard stopped it; rank 0 then died of the
    closed connection (a TP2 conversion that wrote rank 0 alone, main 2024-07-01 … 07-10)."""
    from megaport.train import log

    stdout = ("> megaport: error: the run was given --load /c and asked to train to iteration 1, but no optimizer "
              "step ran on this rank (the checkpoint did not load, or the run stopped before training)\n")
    stderr = "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:11429\n"
    first = log.failure_message(1, stdout, stderr, 0).splitlines()[0]
    assert "no optimizer step ran on this rank" in first and "Connection closed" not in first


def test_a_run_whose_rendezvous_port_was_taken_in_between_runs_once_more(monkeypatch):
    """A port free when chosen can be bound by another run before torchrun binds it (a cross-load row
    of e3-2023-07 died of EADDRINUSE while two verifies shared the machine): tried once more; any
    other failure is raised as it is."""
    from megaport.train import failure, pretrain

    calls = []

    def once(run, env, timeout):
        calls.append(run)
        if len(calls) == 1:
            raise failure.RunFailed("DistNetworkError: The server socket has failed to listen on any local network "
                                    "address. port: 45673, code: -98, name: EADDRINUSE", [])
        return {"losses": [1.0]}

    monkeypatch.setattr(pretrain, "_run_pretrain_once", once)
    assert pretrain._run_pretrain("run", None) == {"losses": [1.0]} and len(calls) == 2

    def dies(run, env, timeout):
        calls.append(run)
        raise failure.RunFailed("AssertionError: loss is nan", [])

    calls.clear()
    monkeypatch.setattr(pretrain, "_run_pretrain_once", dies)
    with pytest.raises(failure.RunFailed, match="nan"):
        pretrain._run_pretrain("run", None)
    assert len(calls) == 1


def test_a_baseline_retried_with_a_shim_starts_from_what_was_there_before(tmp_path):
    """core 0.9's unported upstream died writing its checkpoint (torch's _write_item), and the retry
    with the shim that answers it was refused: "Checkpoint destination directory ... is not empty".
    The failed attempt's writing is taken back; a checkpoint that was there before it stays."""
    from megaport.train import baseline

    save = tmp_path / "cross"
    (save / "iter_0000010").mkdir(parents=True)  # what the run resumes from, there before it
    died = failure.Failure("RuntimeError", "Worker failure: _write_item() missing 2 required positional arguments: "
                           "'storage_key' and 'serialization_format'", (failure.Frame(
                               "/tmp/u/megatron/core/dist_checkpointing/strategies/filesystem_async.py", 308,
                               "write_preloaded_data_multiproc", "raise RuntimeError(...)"),))
    seen = []

    def start(env):
        seen.append(sorted(os.listdir(save)))
        if len(seen) == 1:
            (save / "iter_0000015").mkdir()
            (save / "iter_0000015" / "__0_0.distcp").write_bytes(b"half")
            raise failure.RunFailed("Worker failure", [died])
        return {"baseline_port_code": []}

    run = pretrain.Run(tree=str(tmp_path), family="gpt", extra=((("--save", str(save)), "saves at 15"),))
    assert baseline.save_folder(run) == str(save)
    result, names = baseline.with_fewest_shims(baseline.clean_retries(start, baseline.save_folder(run)), {})
    assert names == ["dcp-write-item"] and seen == [["iter_0000010"], ["iter_0000010"]]


def test_the_harness_keeps_upstreams_bias_gelu_fusion_on_its_unported_side(monkeypatch):
    """PyPI's megatron-core without megatron/training trains through the harness's own config: its
    unported side keeps upstream's fused bias-GeLU too (the same yardstick as the parser's runs),
    and turns off what a ROCm user must (the softmax kernel)."""
    import dataclasses as dc
    import types

    import torch

    from megaport.train.harness import worker

    @dc.dataclass
    class TransformerConfig:
        num_layers: int = 1
        hidden_size: int = 1
        num_attention_heads: int = 1
        masked_softmax_fusion: bool = True
        bias_activation_fusion: bool = True
        bias_dropout_fusion: bool = True

    monkeypatch.setitem(sys.modules, "megatron.core.transformer.transformer_config",
                        types.SimpleNamespace(TransformerConfig=TransformerConfig))
    monkeypatch.setattr(worker, "_ddp_module", lambda: None)
    facts: dict = {}
    config, _ = worker._config(worker.HarnessRun(mode="fusions-off", dtype="fp32"), torch, facts)
    assert config.bias_activation_fusion and not config.masked_softmax_fusion and not config.bias_dropout_fusion


def test_gpts_core_datasets_before_mock_data_get_a_validation_split(tmp_path):
    """2023-10-26 … 2024-01-26: pretrain_gpt.py built its data with megatron.core's builder, which
    refused a validation split of no samples, and the parser had no --mock-data yet."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron/arguments.py").write_text("group.add_argument('--data-path', nargs='*')\n")
    (tmp_path / "pretrain_gpt.py").write_text("from megatron.data.gpt_dataset import build_train_valid_test_datasets\n")
    assert not example.core_data_pipeline(str(tmp_path), "pretrain_gpt.py")
    (tmp_path / "pretrain_gpt.py").write_text("train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(\n")
    assert example.core_data_pipeline(str(tmp_path), "pretrain_gpt.py")
    assert not example.core_data_pipeline(str(tmp_path), "pretrain_bert.py")
