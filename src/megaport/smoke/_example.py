"""Upstream's example command for an era, shrunk in size only.

The proof that a port works is upstream's own ``pretrain_gpt.py`` with the flags of upstream's
example script. Both ways megaport trains use the flags from here: in-process through upstream's
parser on the CPU (:mod:`megaport.smoke._gpt`) and ``torchrun pretrain_gpt.py`` on a GPU
(:mod:`megaport.smoke._pretrain`). Only sizes, parallelism (one rank) and I/O are replaced; every
feature flag stays as the script has it.
"""

from __future__ import annotations

import os
import re

#: The example scripts, newest layout first; a tree that has one is read.
EXAMPLE_SCRIPTS = ("examples/gpt3/train_gpt3_175b_distributed.sh", "examples/pretrain_gpt.sh",
                   "examples/pretrain_gpt_distributed.sh")
EXAMPLE_SCRIPT = EXAMPLE_SCRIPTS[0]
# upstream's examples/gpt3/train_gpt3_175b_distributed.sh (2024 to today): its model, training and
# parallelism flags, for trees without examples/ (PyPI's megatron-core).
EXAMPLE_FLAGS = (
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--max-position-embeddings 2048 --attention-backend auto "
    "--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 "
    "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
    "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 "
    "--lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16"
).split()
#: Flags whose values are paths or I/O, replaced by the run's data; and the batch-size ramp-up, a
#: schedule over millions of samples (some eras refuse it with --train-iters) that says nothing at
#: a few steps.
IO_FLAGS = ("--data-path", "--vocab-file", "--merge-file", "--save", "--load", "--tensorboard-dir",
            "--save-interval", "--eval-interval", "--eval-iters", "--log-interval", "--split",
            "--rampup-batch-size")
#: torchrun's own flags, which the scripts pass before pretrain_gpt.py.
LAUNCHER_FLAGS = ("--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
                  "--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_backend",
                  "--rdzv-backend", "--rdzv_endpoint", "--rdzv-endpoint", "--standalone")
#: Logging and evaluation of a short run: every iteration logged, no evaluation.
SHORT_RUN = ["--split", "949,50,1", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0"]
#: What a ROCm user without megaport adds to run upstream at all.
FUSIONS_OFF_FLAGS = ["--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                     "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                     "--transformer-impl", "local"]
#: Where upstream's parser is defined, newest layout first.
ARGUMENT_FILES = ("megatron/training/arguments.py", "megatron/arguments.py")


def example_flags(tree: str) -> tuple[list, str]:
    """The example script's flags (see :func:`script_flags`) and where they came from: the tree's
    script, else the copy above."""
    for rel in EXAMPLE_SCRIPTS:
        path = os.path.join(tree, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return script_flags(f.read()), f"{rel} of the tree"
    return list(EXAMPLE_FLAGS), f"{EXAMPLE_SCRIPT} as of 2024-2026 (the tree has no example script)"


def script_flags(text: str) -> list:
    """The flags a shell script passes to pretrain_gpt.py, in order: every ``--flag value...`` in
    it (``ARGS=( ... )`` arrays, ``ARGS="..."`` strings or one command line alike) but torchrun's,
    without comments, quotes, or flags whose values are shell variables (paths). A flag's values
    end at the next flag or the end of its (continued) line."""
    out = []
    for line in re.sub(r"#[^\n]*", "", text.replace("\\\n", " ")).splitlines():
        tokens = [t for t in (raw.strip("\"'()") for raw in line.split()) if t]
        i = 0
        while i < len(tokens):
            flag = tokens[i]
            i += 1
            if not re.fullmatch(r"--[A-Za-z0-9][-A-Za-z0-9_]*", flag):
                continue
            values = []
            while i < len(tokens) and not tokens[i].startswith("--"):
                values.append(tokens[i])
                i += 1
            if flag in LAUNCHER_FLAGS or any("$" in v or "<" in v for v in values):
                continue
            out += [flag, *values]
    return out


def parser_has(tree: str, flag: str) -> bool:
    """True when the tree's argument parser defines ``flag``."""
    for rel in ARGUMENT_FILES:
        path = os.path.join(tree, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            return f"'{flag}'" in text or f'"{flag}"' in text
    return False


def mock_data(run) -> list:
    """Data flags for eras whose parser has ``--mock-data``: mock data and the NullTokenizer."""
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(run.vocab), *SHORT_RUN]


def shrunk(tokens: list, run, *, data: list) -> list:
    """The script's flags with sizes, steps and seed from ``run`` (a :class:`_gpt.Run`), one rank,
    ``data`` in place of its I/O, and no dropout (same losses on every run)."""
    sizes = {"--num-layers": [run.layers], "--hidden-size": [run.hidden], "--num-attention-heads": [run.heads],
             "--seq-length": [run.seq], "--max-position-embeddings": [run.seq], "--micro-batch-size": [run.batch],
             "--global-batch-size": [run.batch],
             "--train-iters": [run.steps], "--lr-decay-iters": [run.steps], "--tensor-model-parallel-size": [1],
             "--pipeline-model-parallel-size": [1], "--lr": [run.lr]}
    out, i = [], 0
    while i < len(tokens):
        flag = tokens[i]
        values = []
        i += 1
        while i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        if flag in IO_FLAGS or not flag.startswith("--"):
            continue
        out += [flag] + [str(v) for v in sizes.get(flag, values)]
    return out + data + ["--seed", str(run.seed), "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
