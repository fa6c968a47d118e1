"""Upstream's example command for an era, shrunk in size only.

The proof that a port works is upstream's own ``pretrain_gpt.py`` with the flags of upstream's
example script (:mod:`megaport.train.pretrain`, on the CPU and on a GPU alike; the in-process
harness for trees without the script, :mod:`megaport.train.harness`, parses the same flags). Only
sizes, iteration counts, parallelism (one rank) and I/O are replaced; every feature flag stays as
the script has it, under the name the era's parser knows it by (:data:`RENAMED`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from dataclasses import dataclass

from megaport.errors import MegaportError
from megaport.train.failure import RunFailed
from megaport.train.tree_files import first_file, tree_says, tree_text

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
#: Flags whose values are paths or I/O, replaced by the run's data (the data source too: a script's
#: --mock-data beside the run's --data-path failed "A single data source must be provided", Llama 3's
#: script on core 0.13's oldest commit, whose mock data the run cannot learn from); and the batch-size
#: ramp-up, a schedule over millions of samples (some eras refuse it with --train-iters) that says
#: nothing at a few steps.
IO_FLAGS = ("--data-path", "--mock-data", "--train-data-path", "--valid-data-path", "--test-data-path",
            "--vocab-file", "--merge-file", "--save", "--load", "--tensorboard-dir",
            "--save-interval", "--eval-interval", "--eval-iters", "--log-interval", "--split",
            "--rampup-batch-size")
#: Flags upstream renamed while its example script kept the old name (the script's run then fails
#: in the parser): old name -> new name, used only where the tree's parser lacks the old one.
RENAMED = {"--activations-checkpoint-method": "--recompute-method",
           "--checkpoint-activations": "--recompute-activations",
           "--distribute-checkpointed-activations": "--distribute-saved-activations"}
#: torchrun's own flags, which the scripts pass before pretrain_gpt.py.
LAUNCHER_FLAGS = ("--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
                  "--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_backend",
                  "--rdzv-backend", "--rdzv_endpoint", "--rdzv-endpoint", "--standalone")
#: Logging and evaluation of a short run: every iteration logged, no evaluation.
SHORT_RUN = ["--split", "949,50,1", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0"]
#: The same for a tiny indexed dataset in eras whose data pipeline is megatron.core's
#: (:func:`core_data_pipeline`): an empty test split would make it loop for ever over zero-token
#: epochs, and its samplers refuse an empty validation set.
SHORT_RUN_CORE_DATA = ["--split", "90,10,0", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1"]
#: The same for BERT's and T5's datasets before megatron.core's (2022-2023): they build the
#: validation split's sample mapping whatever --eval-iters says, and refuse zero samples.
SHORT_RUN_SENTENCES = [*SHORT_RUN[:-1], "1"]
#: What a ROCm user without megaport adds to run upstream at all (those the era's parser has).
#: Not ``--no-bias-gelu-fusion``: that fusion is upstream's own torch.jit code, which runs on ROCm
#: and which the port does not touch, and it computes another function than the unfused path (the
#: tanh approximation of GELU against F.gelu's erf). With it off on the unported side only, parity
#: compared two GELUs, not the port: the fork's GPT at TP2×PP2 (mds-2024-09, 6acc370a) was 24 %
#: apart in grad norm from unported upstream, and 0.7 % with the fusion on both sides.
#: ``--no-scaled-masked-softmax-fusion`` is the softmax's flag as v2.0 (2021-01-12) named it, until f34cc86b31.
FUSIONS_OFF_FLAGS = ["--no-masked-softmax-fusion", "--no-scaled-masked-softmax-fusion",
                     "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                     "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                     "--no-rope-fusion", "--transformer-impl", "local"]
#: Where upstream's parser is defined, newest layout first.
ARGUMENT_FILES = ("megatron/training/arguments.py", "megatron/arguments.py")
#: Where E7-E8 declare what arguments.py declared before (config dataclasses, made into flags).
CONFIG_FILES = ("megatron/training/config/common_config.py", "megatron/training/config/model_config.py")


def example_flags(tree: str) -> tuple[list, str]:
    """The example script's flags (see :func:`script_flags`) and where they came from: the tree's
    script, else the copy above."""
    for rel in EXAMPLE_SCRIPTS:
        text = tree_text(tree, rel)
        if text is not None:
            return script_flags(text), f"{rel} of the tree"
    return list(EXAMPLE_FLAGS), f"{EXAMPLE_SCRIPT} as of 2024-2026 (the tree has no example script)"


def _words(line: str) -> list:
    """A shell line's words: quotes group (a quoted schedule stays one value), comments end it."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: the line is not one of the flags' lines
        return []


def script_flags(text: str, *, quoted_strings: bool = False) -> list:
    """The flags a shell script passes to pretrain_gpt.py, in order: every ``--flag value...`` in
    it (``ARGS=( ... )`` arrays, ``ARGS="..."`` strings or one command line alike) but torchrun's,
    without comments, or flags whose values are shell variables (paths). A flag's values end at the
    next flag or the end of its (continued) line; a quoted value stays one value. With
    ``quoted_strings``, the last line of a multi-line ``ARGS="...`` string whose closing quote follows
    a continuation (T5's 2024 script) is read too, and a quoted ``"--flag value"`` word is a flag and
    its value (Llama 3's array entries); GPT's reading predates both and stays as it was."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\s*\w+=\(|^\s*\)", " ", line)  # ARGS=( ... ) array brackets
        words = _words(line)
        if quoted_strings and not words and line.count('"') % 2:  # the end of a quoted multi-line ARGS="..." string
            words = _words(line.replace('"', " "))
        if len(words) == 1 and "--" in words[0] and re.match(r"^\s*\w+=\"", line):
            words = _words(words[0].split("=", 1)[1])  # ARGS="--a 1 --b 2"
        tokens = [t for t in (w.strip("()") for w in words) if t]
        if quoted_strings:  # ARGS+=("--fp8-format hybrid" ...): a quoted flag and its value, one word each
            tokens = [part for t in tokens for part in (t.split() if t.startswith("--") else [t])]
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


def flag_value(tokens: list, flag: str) -> str | None:
    """The last value given for ``flag`` in ``tokens`` (argparse's answer), or None."""
    values = [values for f, values in group_flags(tokens) if f == flag and values]
    return values[-1][0] if values else None


def parser_has(tree: str, flag: str) -> bool:
    """True when the era's argument parser defines ``flag``: written out in its argument file, or
    (from core 0.16, whose parser also makes flags from config dataclass fields) among the options
    of the era's own parser. The era is the unported commit a ported tree records."""
    text = parser_text(tree)
    if f"'{flag}'" in text or f'"{flag}"' in text:
        return True
    generated = first_file(tree, "megatron/training/argument_utils.py") is not None
    return generated and flag in parser_help_flags(tree)


_HELP_CACHE: dict = {}


def parser_help_flags(tree: str) -> frozenset:
    """Every option of the era's own parser, as it builds it (run once per tree, with the CPU
    substitutions: the parser is built after the imports): the unported upstream commit's parser
    where the tree records one (:mod:`megaport.train.tree_files`), exported once per process."""
    import json

    from megaport.train.launch import OPTIONS

    if tree not in _HELP_CACHE:
        folder = _unported_folder(tree)
        try:
            stdout = _run_to_the_parser(folder)
        except RuntimeError as exc:  # (RunFailed among them) no parser, no era facts: every flag would read as absent and its layouts vanish
            raise MegaportError(f"upstream's pretrain_gpt.py ({folder}) stopped before its argument parser, so "
                                f"the era's flags cannot be read: {_last_error(str(exc), folder)}", exit_code=2)
        lines = [line[len(OPTIONS):] for line in stdout.splitlines() if line.startswith(OPTIONS)]
        _HELP_CACHE[tree] = frozenset(json.loads(lines[0]))
    return _HELP_CACHE[tree]


def _run_to_the_parser(folder: str) -> str:
    """The stdout of upstream's pretrain_gpt.py in ``folder`` run to its argument parser, as the
    unported baseline runs (:func:`megaport.train.baseline.with_shims_as_needed`): where it dies of a
    failure a baseline shim answers (an upstream window whose imports fail on every machine: main
    5f5741db9b's experts imported a module upstream never had), once more with that shim, which
    mends an import, never the parser it reaches. RunFailed (its stderr) where it never gets there."""
    import subprocess
    import sys
    import tempfile

    from megaport.envpaths import with_paths_first
    from megaport.train import failure
    from megaport.train.baseline import with_shims_as_needed
    from megaport.train.launch import OPTIONS

    def to_the_parser(env: dict) -> str:
        with tempfile.TemporaryDirectory(prefix="megaport-parser-") as failures:
            proc = subprocess.run([sys.executable, "-m", "megaport.train.launch", "--list-options", "--cpu",
                                   "pretrain_gpt.py"], cwd=folder, env={**env, failure.FAILURE_DIR_ENV: failures},
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if OPTIONS not in proc.stdout:
                raise RunFailed(proc.stderr, failure.read(failures))
        return proc.stdout

    return with_shims_as_needed(to_the_parser, with_paths_first(None, folder), attempts=4)[0]


def _last_error(stderr: str, folder: str = "") -> str:
    """The exception line of a traceback, with what to do where a package is missing (not where
    the missing module is the tree's own: upstream's bug, not the user's install)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception)\b", line)),
                 lines[-1] if lines else "no output")
    missing = re.match(r"ModuleNotFoundError: No module named '([\w]+)", error)
    if missing and folder and os.path.isdir(os.path.join(folder, missing.group(1))):
        return f"{error} (a module of the tree's own package: upstream's code at this commit)"
    return f"{error} (upstream imports it: pip install {missing.group(1)})" if missing else error


def _unported_folder(tree: str) -> str:
    """The tree's unported upstream commit, exported (the tree itself where it records none)."""
    from megaport.train.tree_files import exported, unported_commit

    sha = unported_commit(tree)
    return exported(tree, sha) if sha else tree


def parser_text(tree: str) -> str:
    """The text of the tree's argument parser (empty when it has none)."""
    return tree_text(tree, *ARGUMENT_FILES) or ""


def parser_choices(tree: str, flag: str) -> tuple | None:
    """The values the tree's argument file lists as ``choices`` for ``flag`` (a literal list in
    its ``add_argument`` call), or None where it lists none (any value, or choices made at run time)."""
    import ast
    import warnings

    text = parser_text(tree)
    if f"'{flag}'" not in text and f'"{flag}"' not in text:
        return None
    with warnings.catch_warnings():  # upstream's help strings hold escapes newer Pythons warn about
        warnings.simplefilter("ignore", SyntaxWarning)
        parsed = ast.parse(text)
    for node in ast.walk(parsed):
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == flag for a in node.args):
            for keyword in node.keywords:
                if keyword.arg == "choices":
                    try:
                        return tuple(ast.literal_eval(keyword.value))
                    except ValueError:  # choices computed at run time
                        return None
    return None


def fusions_off_flags(tree: str) -> list:
    """:data:`FUSIONS_OFF_FLAGS` less those the era's parser would refuse (``--no-rope-fusion``
    exists from 2024-01, ``--transformer-impl`` from 2022-12)."""
    out, i = [], 0
    while i < len(FUSIONS_OFF_FLAGS):
        flag = FUSIONS_OFF_FLAGS[i]
        takes = 2 if flag == "--transformer-impl" else 1
        if parser_has(tree, flag):
            out += FUSIONS_OFF_FLAGS[i:i + takes]
        i += takes
    return out


@dataclass
class Sizes:
    """What a shrunk run changes: model and batch sizes, and how many iterations."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    batch: int = 2
    # fp16 runs skip ~16 iterations while the loss scale settles; at the example's learning rate the
    # loss then needs some 80 iterations to fall clearly above its noise
    steps: int = 100
    # mock data's vocabulary (NullTokenizer): core 0.10-0.12's mock documents count up to 4096
    vocab: int = 4096
    # what the padded vocabulary is a multiple of, whatever the run's TP size (runs compared across
    # layouts load one checkpoint, whose embedding has one padded size); None: upstream's padding
    vocab_multiple: int | None = None


#: Loss parity's learning rate where the example's is lower: at the examples' 6e-5 … 1.5e-4 the
#: loss moves ~0.5 % in a hundred iterations, and parity then holds whatever the optimizer does.
#: At 3e-3 it falls by a third or more in every era (measured: 2022-06 5.98 → 2.67, main 5.55 → 1.81).
PARITY_LEARNING_RATE = 3e-3
#: The mock data's vocabulary for parity where its documents count modulo the vocabulary (core
#: 0.13 on): small enough that a short run learns each next token.
LEARNABLE_MOCK_VOCAB = 256
_MOCK_DATASET = "megatron/core/datasets/gpt_dataset.py"


def parity_learning_rate(tree: str, tokens: list | None = None,
                         rate: float = PARITY_LEARNING_RATE) -> float | None:
    """``rate`` (:data:`PARITY_LEARNING_RATE` unless a family sets its own) where the example's
    learning rate (in ``tokens``, a family's flags; GPT's example by default) is lower, else None
    (keep it)."""
    if tokens is None:
        tokens, _ = example_flags(tree)
    given = flag_value(tokens, "--lr")
    return rate if given is None or float(given) < rate else None


def core_data_pipeline(tree: str, entry_point: str) -> bool:
    """Whether ``entry_point`` reads its data through megatron.core's dataset builder: every era
    with ``--mock-data``, and GPT from 2023-10-26 (2a2b91144d), three months before the flag, where
    the builder refused a validation split of no samples (``assert num_samples > 0``: core-0.4-0.5's
    oldest commit trained nothing)."""
    return parser_has(tree, "--mock-data") or tree_says(tree, entry_point, "BlendedMegatronDatasetBuilder")


def mock_data_is_learnable(tree: str) -> bool:
    """Whether the tree's mock documents count modulo the vocabulary (core 0.13 on), so a small
    vocabulary makes them learnable in a short run; older ones count up to 4096 whatever it is,
    which a hundred iterations at two sequences each barely begin to learn."""
    return tree_says(tree, _MOCK_DATASET, "% self.vocab_size")


def parity_data(sizes: Sizes, tree: str) -> tuple:
    """Data and sizes for a loss-parity run, in which the model must measurably learn: (sizes,
    "mock" or "indexed"). Mock data with a small vocabulary where it is learnable; elsewhere the
    tiny indexed dataset of learnable documents (which the eras without --mock-data train on anyway)."""
    if mock_data_is_learnable(tree):
        return dataclasses.replace(sizes, vocab=min(sizes.vocab, LEARNABLE_MOCK_VOCAB)), "mock"
    return sizes, "indexed"


def mock_data(sizes: Sizes) -> list:
    """Data flags for eras whose parser has ``--mock-data``: mock data and the NullTokenizer. One
    evaluation iteration (at the end only): 2024's samplers refuse an empty validation set."""
    short = [*SHORT_RUN[:SHORT_RUN.index("--eval-iters")], "--eval-iters", "1"]
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(sizes.vocab), *short]


def group_flags(tokens: list) -> list:
    """``[(flag, [values...]), ...]`` in order."""
    out, i = [], 0
    while i < len(tokens):
        flag, values = tokens[i], []
        i += 1
        while i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        out.append((flag, values))
    return out


def without(tokens: list, left_out: dict, notes: list) -> list:
    """``tokens`` less the flags (and their values) in ``left_out`` (``{flag: why}``), each said in ``notes``."""
    out = []
    for flag, values in group_flags(tokens):
        if flag in left_out:
            notes.append(f"{flag} left out ({left_out[flag]})")
        else:
            out += [flag, *values]
    return out


def shrunk(tokens: list, sizes: Sizes, *, data: list, tree: str | None = None,
           notes: list | None = None, more_sizes: dict | None = None) -> list:
    """The script's flags with ``sizes``, one rank, and ``data`` in place of its I/O.

    With ``tree``, a flag upstream renamed after the script was written takes the name the tree's
    parser knows (:data:`RENAMED`). A step batch-size schedule (samples into the billions) becomes
    one step at the run's batch, and then ``--global-batch-size``, which upstream's parser refuses
    beside a schedule (its own script passes both), is left out. What changed goes to ``notes``.
    """
    notes = [] if notes is None else notes
    values_of = {"--num-layers": [sizes.layers], "--hidden-size": [sizes.hidden],
                 "--num-attention-heads": [sizes.heads], "--seq-length": [sizes.seq],
                 "--max-position-embeddings": [sizes.seq], "--micro-batch-size": [sizes.batch],
                 "--global-batch-size": [sizes.batch], "--train-iters": [sizes.steps],
                 "--lr-decay-iters": [sizes.steps], "--tensor-model-parallel-size": [1],
                 "--pipeline-model-parallel-size": [1],
                 "--step-batch-size-schedule": [f"0:{sizes.batch}"], **(more_sizes or {})}
    groups = [(f, v) for f, v in group_flags(tokens) if f.startswith("--") and f not in IO_FLAGS]
    flags = {f for f, _ in groups}
    if "--step-batch-size-schedule" in flags and "--global-batch-size" in flags:
        groups = [(f, v) for f, v in groups if f != "--global-batch-size"]
        notes.append("--step-batch-size-schedule shrunk to one step at the run's batch; --global-batch-size "
                     "left out (upstream's parser refuses both, which its script passes)")
    text = parser_text(tree) if tree else ""
    out = []
    for flag, values in groups:
        new = RENAMED.get(flag)
        if text and new and not parser_has(tree, flag) and parser_has(tree, new):
            notes.append(f"{flag} is {new} in this era's parser (upstream renamed it; its script kept the old name)")
            flag = new
        out += [flag] + [str(v) for v in values_of.get(flag, values)]
    return out + data
