"""The GPU path of training through upstream's entry point, checked on the CPU: the example flags
read from each shape of upstream's scripts, the tiny indexed dataset read back by upstream's own
reader, upstream's log format, and the torchrun launch (with a stand-in pretrain_gpt.py, since
upstream's training loop needs a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megaport.smoke import _example, _gpt, _pretrain

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


@pytest.mark.parametrize("text,flags", [
    (ARRAYS, ["--num-layers", "96", "--hidden-size", "12288", "--seq-length", "2048", "--micro-batch-size", "1",
              "--rampup-batch-size", "16", "16", "5859375", "--fp16", "--lr", "6.0e-5", "--split", "949,50,1"]),
    (STRINGS, ["--num-layers", "24", "--hidden-size", "1024", "--lr", "0.00015", "--fp16", "--split", "949,50,1"]),
    (COMMAND_LINE, ["--num-layers", "24", "--hidden-size", "1024", "--vocab-file", "gpt2-vocab.json",
                    "--DDP-impl", "local", "--checkpoint-activations", "--fp16"]),
], ids=["arrays", "strings", "command-line"])
def test_example_flags_are_read_from_every_script_shape(text, flags):
    assert _example.script_flags(text) == flags


def test_shrinking_changes_sizes_and_io_only():
    run = _gpt.Run(tree=".", layers=2, hidden=64, heads=4, seq=128, batch=2, steps=5)
    flags = _example.shrunk(_example.script_flags(ARRAYS), run, data=["--mock-data"])
    assert flags[:6] == ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "128"]
    assert "--fp16" in flags and "--rampup-batch-size" not in flags and "--data-path" not in flags
    assert flags.count("--split") == 0 and "--mock-data" in flags


def test_the_tiny_dataset_reads_back_through_upstreams_reader(core_upstream, tmp_path):
    docs = _pretrain.learnable_documents(12, 40, 257, seed=3)
    prefix = str(tmp_path / "tiny_text_document")
    _pretrain.write_indexed_dataset(prefix, docs)
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
    vocab_file, merges_file = _pretrain.write_gpt2_vocabulary(str(tmp_path))
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    assert len(vocab) == 257 and vocab[_pretrain.EOD] == 256
    assert sorted(vocab.values()) == list(range(257))
    assert vocab["A"] == ord("A") - ord("!") and chr(256) in vocab  # printable bytes as themselves
    assert Path(merges_file).read_text() == "#version: 0.2\n"


LOG = """\
 [2025-01-01 00:00:01] iteration        1/      30 | consumed samples:            2 | elapsed time per iteration (ms): 900.5 | learning rate: 1.000000E-03 | global batch size:     2 | loss scale: 4294967296.0 | number of skipped iterations:   1 | number of nan iterations:   0 |
 [2025-01-01 00:00:02] iteration        2/      30 | consumed samples:            4 | elapsed time per iteration (ms): 41.2 | learning rate: 1.000000E-03 | global batch size:     2 | lm loss: 5.612345E+00 | loss scale: 2147483648.0 | grad norm: 3.210 | number of skipped iterations:   0 | number of nan iterations:   0 |
 iteration        3/      30 | consumed samples:            6 | elapsed time per iteration (ms): 40.8 | learning rate: 1.000000E-03 | global batch size:     2 | lm loss: 5.101000E+00 | loss scale: 2147483648.0 |
"""


def test_upstreams_log_lines_give_loss_and_time_per_iteration():
    found = _pretrain.parse_log(LOG + "unrelated line with iteration 9\n")
    assert [(i.iteration, i.loss, i.ms) for i in found] == [(2, 5.612345, 41.2), (3, 5.101, 40.8)]


def fake_tree(tmp_path: Path, exit_code: int = 0) -> Path:
    """A tree whose pretrain_gpt.py prints upstream's log lines for the iterations it is asked
    for, with a falling loss, after checking it got the flags a user's run would give it."""
    tree = tmp_path / "tree"
    (tree / "megatron/training").mkdir(parents=True)
    (tree / "megatron/training/arguments.py").write_text("group.add_argument('--mock-data', action='store_true')\n")
    (tree / "pretrain_gpt.py").write_text(f"""
import os, sys
args = sys.argv[1:]
assert os.environ["LOCAL_RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"  # started by torchrun
assert "--mock-data" in args and "--fp16" in args, args
steps = int(args[args.index("--train-iters") + 1])
for it in range(1, steps + 1):
    print(f" iteration {{it:8d}}/{{steps:8d}} | elapsed time per iteration (ms): {{100 + it}}.0 | lm loss: {{10.0 / it:E}} |")
if {exit_code}:
    print("RuntimeError: the rank's own reason", file=sys.stderr)
sys.exit({exit_code})
""")
    return tree


def test_run_pretrain_launches_torchrun_and_reads_the_log(tmp_path):
    tree = fake_tree(tmp_path)
    run = _gpt.Run(tree=str(tree), steps=8, warmup=2)
    result = _pretrain.run_pretrain(str(tree), run)
    assert result["iterations"] == list(range(1, 9)) and result["losses"][-1] == pytest.approx(10 / 8)
    assert result["ms_per_iter"] == 106.0  # median of iterations 3..8
    assert "torch.distributed.run" in result["command"] and "pretrain_gpt.py" in result["command"]
    assert result["data"] == "mock data, NullTokenizer"


def test_a_failing_run_says_why(tmp_path):
    tree = fake_tree(tmp_path, exit_code=3)
    with pytest.raises(RuntimeError, match=r"failed \(exit code 3\) after 4 logged iterations") as failure:
        _pretrain.run_pretrain(str(tree), _gpt.Run(tree=str(tree), steps=4))
    assert "lm loss" in str(failure.value) and "ChildFailedError" not in str(failure.value)


def test_eras_without_mock_data_get_files_the_command_names(tmp_path):
    tree = tmp_path / "old"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron/arguments.py").write_text("group.add_argument('--data-path', nargs='*')\n")
    (tree / "examples").mkdir()
    (tree / "examples/pretrain_gpt.sh").write_text(COMMAND_LINE)
    run = _gpt.Run(tree=str(tree), steps=4, seq=32, batch=2)
    cmd = _pretrain.command(str(tree), run, str(tmp_path))
    argv = cmd.argv
    assert argv[argv.index("--tokenizer-type") + 1] == "GPT2BPETokenizer" and "--mock-data" not in argv
    assert Path(argv[argv.index("--data-path") + 1] + ".idx").is_file()
    assert argv[argv.index("--vocab-file") + 1] == str(tmp_path / "vocab.json")  # ours, not the script's
    assert "--DDP-impl" in argv and "--checkpoint-activations" in argv  # the era's feature flags stay
    assert any("no --mock-data" in note for note in cmd.notes)


def test_bench_train_runs_both_sides_through_pretrain_gpt(tmp_path):
    """bench --train's GPU entry: the ported tree as it is, and its upstream commit exported next to
    it with the fusions off, each through pretrain_gpt.py under torchrun."""
    from megaport.commands import bench_train

    tree = fake_tree(tmp_path)
    script = tree / "pretrain_gpt.py"
    script.write_text(script.read_text().replace(
        'sys.exit(', 'print(" [Rank 0] (after 1 iterations) memory (MB) | allocated: 10.0 | max allocated: '
        '{}"'.format("{}") + '.format(64.0 if "--no-masked-softmax-fusion" in args else 48.0))\nsys.exit(', 1))
    for args in (["init", "--quiet"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "up"]):
        subprocess.run(["git", *args], cwd=tree, check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    sizes = dict(layers=1, hidden=64, heads=4, seq=32, batch=2, steps=6, warmup=1, vocab=128, device="cuda")
    ported, what = bench_train._pretrain_side(tree, sha, "ported", {}, sizes)
    upstream, against = bench_train._pretrain_side(tree, sha, "upstream", {}, sizes)
    assert what is None and against == "unported upstream's pretrain_gpt.py, fusions off"
    assert ported["losses"] == upstream["losses"] and len(ported["losses"]) == 6
    assert ported["peak_memory_bytes"] == 48 * 2**20 and upstream["peak_memory_bytes"] == 64 * 2**20
    assert "--no-masked-softmax-fusion" in upstream["command"] and "--no-masked-softmax-fusion" not in ported["command"]
    assert bench_train._entry("auto", "cuda", tree) == "pretrain"
    assert bench_train._entry("auto", "cpu", tree) == "harness"
    with pytest.raises(Exception, match="needs a GPU"):
        bench_train._entry("pretrain", "cpu", tree)


def test_print_command_needs_a_megatron_lm_tree(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        _pretrain.main(["--tree", str(tmp_path), "--print-command"])
    assert stopped.value.code == 2 and "has no pretrain_gpt.py" in capsys.readouterr().err
    tree = fake_tree(tmp_path)
    assert _pretrain.main(["--tree", str(tree), "--print-command", "--workdir", str(tmp_path / "w")]) == 0
    assert "pretrain_gpt.py --num-layers 2" in capsys.readouterr().out
