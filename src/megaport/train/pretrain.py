"""Upstream's own entry point, on the CPU or a GPU: ``pretrain_gpt.py`` with the era's example flags.

What a ROCm user runs after ``megaport apply`` is upstream's ``pretrain_gpt.py`` with the flags of
upstream's example script. ``megaport verify`` and ``megaport bench --train`` run exactly that,
changed in size only (:mod:`megaport.train.example`), under torchrun, and read upstream's own
training log (:mod:`megaport.train.log`):

    python -m megaport.train.pretrain --tree DIR [--device cpu|cuda] [--mode ported|fusions-off]
                                      [--layers 2 --hidden 64 ...] [--print-command]

Data: mock data where the era's parser has ``--mock-data``, else a tiny indexed dataset and GPT-2
vocabulary written for the run (:mod:`megaport.train.data`). On a machine without a GPU the rank
runs with the CPU substitutions of :mod:`megaport.cpu_substitutions`, listed in the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field

from megaport import deepspeed_fork
from megaport.cpu_substitutions import MARK as CPU_MARK
from megaport.envpaths import with_paths_first
from megaport.train import deepspeed_example, example, failure, log, torchrun
from megaport.train.families.spec import legacy_gqa_view
from megaport.train.layouts import registry as layouts
from megaport.train.preloaded import servers
from megaport.train.preloaded import launcher as forked_launcher
from megaport.train.preloaded.protocol import MARK as STARTED
from megaport.train.shims import audit
from megaport.train.launch import PEAK

MODES = ("ported", "fusions-off")
_PEAK = re.compile(re.escape(PEAK) + r" (\d+) bytes \(([^)]*)\)")
#: Sizes of a run on a GPU: large enough that the kernels, not the launch overhead, are timed.
GPU_SIZES = example.Sizes(layers=2, hidden=256, heads=4, seq=512, batch=2)


@dataclass
class Run:
    """One run of the tree's pretrain_gpt.py."""

    tree: str
    mode: str = "ported"  # or "fusions-off": what a ROCm user without megaport runs
    device: str = "cpu"  # or "cuda": a GPU (HIP on ROCm)
    sizes: example.Sizes = field(default_factory=example.Sizes)
    warmup: int = 3  # logged iterations left out of ms/iter (compilation, allocator warm-up)
    dropout: float | None = None  # None keeps the example's; 0.0 where loss parity needs it
    # None keeps the example's learning rate; loss parity raises it where the example's would not
    # let the model learn measurably in a short run (see PARITY_LEARNING_RATE)
    lr: float | None = None
    # fp16's initial dynamic loss scale (None: the example's). Loss parity starts it where no step
    # overflows: a step one run skips for an overflow and the other takes parts their trajectories
    initial_loss_scale: float | None = None
    # "mock" (upstream's mock dataset, where the parser has --mock-data) or "indexed" (a tiny
    # indexed dataset written for the run); None: mock where the parser has it
    data: str | None = None
    # More flags, each group with why it was added: ((flags...), note), ...
    extra: tuple = ()
    #: the family's flags left out of this run, each with why: ((flag, why), ...)
    left_out: tuple = ()
    #: how the run is spread over ranks (:mod:`megaport.train.layouts`); "one-rank" by default
    layout: str = "one-rank"
    #: where the run writes its weights after its last iteration (None: nowhere)
    save: str | None = None
    #: whether it writes them one file per rank (upstream's legacy ``torch`` format, which keeps
    #: every rank's copy of a shared weight) rather than in the distributed format (one copy)
    save_per_rank: bool = False
    #: a checkpoint the run starts from: its weights only, iteration, optimizer and RNG fresh
    #: (upstream's --finetune --no-load-optim --no-load-rng), resharded to the run's layout
    load: str | None = None
    # Megatron-DeepSpeed trees: "deepspeed" (the example's --deepspeed, DeepSpeed's engine) or
    # "megatron" (its DeepSpeed flags left out: Megatron's own loop). Upstream trees ignore it.
    engine: str = "deepspeed"
    # the model family (megaport.train.families): its entry point, flags, sizes' flags and data
    family: str = "gpt"


@dataclass
class Command:
    """What runs: argv, working directory, what the data is, and what was changed to run it."""

    argv: list
    cwd: str
    data: str
    notes: list = field(default_factory=list)
    #: environment variables the run's data needs (an offline tokenizer cache), set on both sides
    env: dict = field(default_factory=dict)
    #: the launchers of the run's other "nodes" (same rendezvous), started beside ``argv``
    other_nodes: list = field(default_factory=list)

    def shell(self, env: dict | None = None) -> str:
        """A line to paste into a shell, with ``env``'s variables set for the command."""
        assigned = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
        return f"cd {shlex.quote(self.cwd)} && " + " ".join(assigned + [shlex.quote(a) for a in self.argv])


def command(run: Run, workdir: str, *, port: int | None = None) -> Command:
    """The torchrun command of the tree's entry point for ``run``'s family (pretrain_gpt.py for
    GPT); data files go to ``workdir``."""
    from megaport.train.families import registry

    family = registry.get(run.family)
    layout = layouts.get(run.layout)
    fork = deepspeed_example.fork_example(
        run.tree, workdir, run.sizes, run.engine, micro_batch=layout.micro_batch,
        pipeline="--pipeline-model-parallel-size" in layout.flags,
        left_out=dict(run.left_out)) if family.fork_example else None
    if fork is not None:
        tokens, notes = fork.tokens, list(fork.notes)
    else:
        tokens, source = family.flags(run.tree)
        notes = [f"flags of {source}, changed in size, iterations and data only"]
        tokens = _family_flags(family, tokens, run.tree, notes, dict(run.left_out))
        if family.deepspeed_config is not None:
            tokens = tokens + family.deepspeed_config(run.tree, workdir, run, notes)
    data, described, data_env = _data(run, family, tokens, workdir, notes)
    flags = example.shrunk(tokens, run.sizes, data=data, tree=run.tree, notes=notes,
                           more_sizes=family.size_flags(run.sizes, run.tree)) + (fork.deepspeed if fork else [])
    if run.mode == "fusions-off":
        flags += example.fusions_off_flags(run.tree)
        for added, why in family.fusions_off_for(run.tree):
            flags += list(added)
            notes.append(f"{' '.join(added)} ({why})")
    if run.dropout is not None:
        flags += ["--hidden-dropout", str(run.dropout), "--attention-dropout", str(run.dropout)]
        notes.append(f"dropout {run.dropout} (for loss parity)")
    for added, why in run.extra:
        flags += list(added)
        notes.append(f"{' '.join(added)} ({why})")
    if run.initial_loss_scale is not None and "--fp16" in flags:
        flags += ["--initial-loss-scale", str(run.initial_loss_scale)]
        notes.append(f"fp16's initial loss scale {run.initial_loss_scale:g} (for loss parity: no step overflows, so "
                     "neither run skips one the other takes)")
    if run.lr is not None:
        flags += ["--lr", str(run.lr)]  # argparse: the last value given wins
        notes.append(f"learning rate {run.lr} (the example's {example.flag_value(flags[:-2], '--lr')}: loss parity "
                     "needs a window where the model measurably learns)")
    flags += _layout_flags(run, layout, notes) + _vocab_padding(run, layout, notes) + _checkpoint_flags(run, notes)
    flags += _mcore_query_groups(run, flags, notes)
    flags += _legacy_view_query_groups(run, flags, notes)
    for name, (value, why) in family.environment_for(run.tree).items():
        notes.append(f"{name}={value} in the environment ({why})")
    target = ["-m", "megaport.train.launch", *(["--cpu"] if run.device == "cpu" else []), family.entry_point, *flags]
    for name, value, why in layout.environment:
        data_env = {**data_env, name: value}
        notes.append(f"{name}={value} in the environment ({why})")
    first, *others = torchrun.node_commands(layout.ranks, target, port=port)
    return Command(first, run.tree, described, notes, data_env, others)


def _layout_flags(run: Run, layout, notes: list) -> list:
    """The layout's flags (and the micro-batch it needs), given after everything else; said once."""
    if layout is layouts.ONE_RANK:
        return []
    flags = layout.flags_for(run.tree)
    for flag, why in layout.optional_left_out(run.tree):
        notes.append(f"{flag} left out ({why})")
    if layout.micro_batch is not None:
        flags += ["--micro-batch-size", str(layout.micro_batch)]
    if legacy_models_by_default(run.tree) and not any("--use-mcore-models" in added for added, _ in run.extra):
        flags += ["--use-mcore-models"]
        notes.append("--use-mcore-models (this era builds legacy models unless told; its parallel features, "
                     "--overlap-param-gather among them, are Megatron Core's)")
    ranks = layout.ranks
    where = f"{ranks.per_node} ranks" if ranks.nodes == 1 else f"{ranks.nodes} nodes of {ranks.per_node} rank(s)"
    notes.append(f"layout {layout.name}: {layout.summary}, {where} ({' '.join(flags)})")
    return flags


def _vocab_padding(run: Run, layout, notes: list) -> list:
    """The padded vocabulary's multiple, whatever the run's TP size, where the run is compared
    with runs in other layouts (``sizes.vocab_multiple``): upstream pads to its divisor times the
    TP size, and one checkpoint's embedding must load in every layout."""
    if not run.sizes.vocab_multiple:
        return []
    divisor = run.sizes.vocab_multiple // layout.tensor_parallel
    notes.append(f"--make-vocab-size-divisible-by {divisor} (the vocabulary padded to a multiple of "
                 f"{run.sizes.vocab_multiple} in every layout compared)")
    return ["--make-vocab-size-divisible-by", str(divisor)]


def legacy_models_by_default(tree: str) -> bool:
    """Whether the era builds legacy models unless told ``--use-mcore-models`` (core 0.5 to 0.6;
    from 0.7 Megatron Core's are the default and ``--use-legacy-models`` asks for the others)."""
    return example.parser_has(tree, "--use-mcore-models") and not example.parser_has(tree, "--use-legacy-models")


def _mcore_query_groups(run: Run, flags: list, notes: list) -> list:
    """Where a run of an era that builds legacy models by default builds Megatron Core's
    (``--use-mcore-models``), its query groups need not be the one the legacy view takes
    (:func:`megaport.train.families.spec.query_groups`): half the heads, which a tensor-parallel
    split divides."""
    if not (legacy_models_by_default(run.tree) and "--use-mcore-models" in flags
            and example.flag_value(flags, "--num-query-groups") == "1"):
        return []
    groups = max(1, run.sizes.heads // 2)
    notes.append(f"--num-query-groups {groups} (Megatron Core's attention takes half the heads as groups; one was for "
                 "the legacy model's view)")
    return ["--num-query-groups", str(groups)]


def _legacy_view_query_groups(run: Run, flags: list, notes: list) -> list:
    """Where a run compared across layouts (``sizes.vocab_multiple``) builds upstream's legacy
    transformer, whose GQA view takes one query group per tensor-parallel rank at most: the one
    group it trains on one rank cannot be split over TP 2 (upstream refuses it: main 2023-10's
    Llama tp2 rows died "num_query_groups (1) must be a multiple of tensor_model_parallel_size (2)"),
    and two groups fail its view on one rank. One head per group is the model both build."""
    if not (run.sizes.vocab_multiple and "--use-mcore-models" not in flags
            and example.flag_value(flags, "--num-query-groups") == "1" and legacy_gqa_view(run.tree)):
        return []
    notes.append(f"--num-query-groups {run.sizes.heads} (one head per group: the legacy transformer's GQA view "
                 "takes one group per tensor-parallel rank, and one group splits over no TP size above 1)")
    return ["--num-query-groups", str(run.sizes.heads)]


def _checkpoint_flags(run: Run, notes: list) -> list:
    """Where the run saves its weights and what it starts from, in the era's checkpoint format
    (:func:`_format_flags`). A checkpoint holds weights only (``--no-save-optim``, on the loading
    side too: core 0.5-0.6 read the optimizer back unless it says so): every run that loads one
    starts its optimizer fresh."""
    flags = _format_flags(run, notes) if (run.save or run.load) else []
    if (run.save or run.load) and example.parser_has(run.tree, "--no-save-optim"):
        # also where it loads: core 0.5-0.6 build the state dict they load from with this same flag
        flags += ["--no-save-optim"]
        notes.append("--no-save-optim (the checkpoint holds weights only: runs that load it start their optimizer "
                     "fresh)")
    if run.save:
        flags += ["--save", run.save, "--save-interval", str(run.sizes.steps)]
        notes.append(f"saves its weights after iteration {run.sizes.steps}"
                     + (" one file per rank (--ckpt-format torch)" if run.save_per_rank else ""))
    if run.load:
        flags += ["--load", run.load, "--finetune", "--no-load-optim", "--no-load-rng"]
        notes.append("starts from a checkpoint's weights (--finetune --no-load-optim --no-load-rng): "
                     "iteration, optimizer and RNG fresh")
    return flags


def _format_flags(run: Run, notes: list) -> list:
    """The era's checkpoint format: upstream's distributed one where the parser has it (it reshards
    to any layout), or, for a run that saves one file per rank (and loads nothing: upstream main
    builds the state dict it loads in the format it saves), the legacy ``torch`` format. Core 0.5
    to 0.6 build legacy models unless told ``--use-mcore-models``, and refuse ``--use-dist-ckpt``
    without it: there every side of the comparison builds Megatron Core's model."""
    if run.save and run.save_per_rank:
        if run.load:
            raise ValueError("a run that saves one file per rank starts from its own initialisation")
        return ["--ckpt-format", "torch"] if example.parser_has(run.tree, "--ckpt-format") else []
    if example.parser_has(run.tree, "--ckpt-format"):
        return ["--ckpt-format", "torch_dist"]
    if not example.parser_has(run.tree, "--use-dist-ckpt"):
        return []
    flags = ["--use-dist-ckpt"]
    if legacy_models_by_default(run.tree):
        flags += ["--use-mcore-models"]
        notes.append("--use-mcore-models (the era's --use-dist-ckpt supports Megatron Core's models only)")
    return flags


def _data(run: Run, family, tokens: list, workdir: str, notes: list) -> tuple:
    """The run's data, written to ``workdir``: (its flags, what it is, the environment it needs)."""
    core_data = example.core_data_pipeline(run.tree, family.entry_point)
    if family.data == "wordpiece":
        return _wordpiece_data(run, tokens, workdir, notes, core_data)
    if (example.parser_has(run.tree, "--mock-data") if run.data is None else run.data == "mock"):
        data, described = example.mock_data(run.sizes), "mock data, NullTokenizer"
    else:
        from megaport.train.data import indexed_data_flags

        data = indexed_data_flags(workdir, run.sizes, example.SHORT_RUN_CORE_DATA if core_data else example.SHORT_RUN)
        data += _legacy_tokenizer(run, notes, "the run's GPT-2 vocabulary and merges files; the new tokenizer "
                                              "system would load gpt2 from the Hugging Face hub, a download")
        described = "a tiny indexed dataset and byte-level GPT-2 vocabulary written for the run"
    return data, described, {}


def _legacy_tokenizer(run: Run, notes: list, why: str) -> list:
    """``--legacy-tokenizer`` where the era's parser has it (main 2025-09-04 … 2026-02-09, core 0.15
    … 0.16): its new tokenizer system builds the GPT-2 and BERT WordPiece tokenizers from the
    Hugging Face hub (``gpt2``, ``bert-large-cased``) even when given the run's vocabulary files,
    which a machine without network (verify's runs, an air-gapped cluster) cannot download: a
    2025-09-09 commit's GPT, Llama, Mixtral and DeepSeek trained nothing, ported or not. The legacy
    system reads the files alone, as every other era does. Both sides of a comparison get it."""
    if not example.parser_has(run.tree, "--legacy-tokenizer"):
        return []
    notes.append(f"--legacy-tokenizer ({why})")
    return ["--legacy-tokenizer"]


def _wordpiece_data(run: Run, tokens: list, workdir: str, notes: list, core_data: bool) -> tuple:
    """BERT's and T5's data (:mod:`megaport.train.wordpiece`) and how the tree's tokenizer reads
    its vocabulary without a download: (flags, what it is, the environment it needs)."""
    from megaport.train import vocab_order
    from megaport.train.wordpiece import hub_tokenizer_name, offline_hub_tokenizer, wordpiece_data_flags

    data_env = {}
    tokenizer = example.flag_value(tokens, "--tokenizer-type") or "BertWordPieceLowerCase"
    data = wordpiece_data_flags(workdir, run.sizes, example.SHORT_RUN_CORE_DATA if core_data else
                                example.SHORT_RUN_SENTENCES, tokenizer)
    described = f"a tiny indexed dataset of multi-sentence documents and a WordPiece vocabulary ({tokenizer}) " \
                "written for the run"
    if legacy := _legacy_tokenizer(run, notes, "the run's WordPiece vocabulary file; the new tokenizer system "
                                                "would download bert-large-cased from the Hugging Face hub"):
        data += legacy
    elif (hub := hub_tokenizer_name(run.tree, tokenizer)) is not None:
        # core 0.17's tokenizer system has no --legacy-tokenizer and loads the hub model even
        # with --vocab-file: the hub's files for it, holding the run's vocabulary, offline
        data_env = offline_hub_tokenizer(workdir, hub, example.flag_value(data, "--vocab-file"))
        notes.append(f"{hub} (what the tree's tokenizer system loads for {tokenizer}, from the Hugging Face hub) "
                     "from a local cache holding the run's WordPiece vocabulary, offline")
        notes.append(f"{vocab_order.NOTE} (for loss parity)")
    return data, described, data_env


def _family_flags(family, tokens: list, tree: str, notes: list, left_out: dict | None = None) -> list:
    """A family's flags for a short run: its added flags, less those it or the run (``left_out``)
    drops (each said in the notes) and, for families other than GPT, less those the era's parser lacks."""
    dropped = {**family.dropped, **(left_out or {})}
    for added, why in family.added:
        present = {t for t in tokens if t.startswith("--")}
        missing = [g for g in example.group_flags(list(added)) if g[0] not in present
                   and (not family.drop_unknown_flags or example.parser_has(tree, g[0]))]
        if missing:
            tokens = tokens + [t for flag, values in missing for t in [flag, *values]]
            notes.append(f"{' '.join(f for f, _ in missing)} added ({why})")
    out = []
    for flag, values in example.group_flags(example.without(tokens, dropped, notes)):
        if family.drop_unknown_flags and flag.startswith("--") and not example.parser_has(tree, flag):
            notes.append(f"{flag} left out (this era's parser has no such flag)")
        elif family.drop_unknown_flags and len(values) == 1 and _refused_choice(tree, flag, values[0]):
            notes.append(f"{flag} {values[0]} left out (this era's parser has no such choice: its default runs)")
        else:
            out += [flag, *values]
    return out


def _refused_choice(tree: str, flag: str, value: str) -> bool:
    """Whether the era's parser lists ``flag``'s choices without ``value`` (a script newer than the
    tree: DeepSeek-V2-Lite's seq_aux_loss on core 0.9)."""
    choices = example.parser_choices(tree, flag)
    return choices is not None and all(str(c) != value for c in choices)


def environment(tree: str, base: dict | None = None) -> dict:
    """The run's environment: the tree first on PYTHONPATH, upstream's scripts' own settings, and
    this interpreter's folders first on PATH, so upstream's dataset-helper Makefile builds for it
    (it calls ``python3`` and ``python3-config``, which a venv lacks)."""
    env = with_paths_first(base, tree)
    folders = [os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or ""]
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", PATH=os.pathsep.join([f for f in folders if f] + [env.get("PATH", "")]))
    return deepspeed_fork.accelerator_env(tree, env)


def run_pretrain(run: Run, env: dict | None = None, *, timeout: float = 1800) -> dict:
    """Run the tree's pretrain_gpt.py for ``run`` and read its log: losses per logged iteration,
    ms/iter (median after ``run.warmup``), tokens/s, peak memory, the command and what the port
    and the CPU substitutions said. Raises RuntimeError with the log's end when it fails.

    A Megatron-DeepSpeed tree runs its example with DeepSpeed's engine; where the engine refuses
    this machine (:func:`deepspeed_example.engine_refused`), it runs again through Megatron's own
    loop, and ``engine`` in the result says which ran and why. A family with its own DeepSpeed
    config (the fork's MoE: its layers' expert groups are the engine's to set up) runs the engine
    only."""
    from megaport.train.families import registry

    if registry.get(run.family).deepspeed_config is not None:
        document = _run_pretrain(run, env, timeout=timeout)
        document["engine"] = {"name": "deepspeed", "described": "DeepSpeed's engine (--deepspeed), with the DeepSpeed "
                                                                "config of the family's script (in the notes)"}
        return document
    if deepspeed_fork.is_deepspeed_tree(run.tree) and run.engine == "deepspeed":
        try:
            document = _run_pretrain(run, env, timeout=timeout)
        except RuntimeError as exc:
            reason = deepspeed_example.engine_refused(str(exc))
            if reason is None:
                raise
            document = _run_pretrain(dataclasses.replace(run, engine="megatron"), env, timeout=timeout)
            document["engine"] = {"name": "megatron", "described": deepspeed_example.DESCRIBE["megatron"],
                                  "deepspeed_refused": reason}
            document["notes"].append(f"DeepSpeed's engine refused this machine ({reason}): Megatron's own loop ran")
            return document
        document["engine"] = _engine_that_ran(document)
        return document
    document = _run_pretrain(run, env, timeout=timeout)
    if deepspeed_fork.is_deepspeed_tree(run.tree):
        document["engine"] = _engine_that_ran(document)
    return document


def _engine_that_ran(document: dict) -> dict:
    """A fork tree's run: DeepSpeed's engine where its command had --deepspeed (GPT's example),
    Megatron's own loop otherwise (the fork's BERT and T5 scripts, or --engine megatron)."""
    name = "deepspeed" if document["deepspeed_engine"] else "megatron"
    return {"name": name, "described": deepspeed_example.DESCRIBE[name]}


#: what torchrun says when the rendezvous port, free when :func:`torchrun.free_port` chose it, was
#: taken before it bound it (another run starting on the machine at that moment)
PORT_TAKEN = "EADDRINUSE"


def _run_pretrain(run: Run, env: dict | None = None, *, timeout: float = 1800) -> dict:
    """:func:`_run_pretrain_once`, once more on another port where the rendezvous port was taken
    in between (seen when two verifies shared this machine: a cross-load row died of it)."""
    try:
        return _run_pretrain_once(run, env, timeout=timeout)
    except failure.RunFailed as exc:
        if PORT_TAKEN not in str(exc):
            raise
        return _run_pretrain_once(run, env, timeout=timeout)


def _run_pretrain_once(run: Run, env: dict | None = None, *, timeout: float = 1800) -> dict:
    with tempfile.TemporaryDirectory(prefix="megaport-pretrain-") as workdir:
        cmd = command(run, workdir)
        failures, audits = os.path.join(workdir, "failures"), os.path.join(workdir, "audits")
        os.makedirs(failures)
        os.makedirs(audits)
        from megaport.train.families import registry

        run_env = {**environment(run.tree, env), failure.FAILURE_DIR_ENV: failures, audit.AUDIT_DIR_ENV: audits,
                   **{k: v for k, (v, _) in registry.get(run.family).environment_for(run.tree).items()}, **cmd.env}
        # on the CPU, torchrun and the ranks fork from the entry point's imports, done once (megaport.train.preloaded)
        served = servers.environment_for(os.path.join(cmd.cwd, _entry_point(cmd, run)), run_env) \
            if run.device == "cpu" else {}
        proc = _run_nodes(cmd, {**run_env, **served}, timeout, forked=bool(served))
        died_of, port_code = failure.read(failures), audit.read(audits)
    text = proc.stdout + "\n" + proc.stderr
    iterations = log.parse_log(text)
    if proc.returncode != 0 or not iterations:
        raise failure.RunFailed(log.failure_message(proc.returncode, proc.stdout, proc.stderr, len(iterations),
                                                    entry_point=_entry_point(cmd, run),
                                                    first_failure=died_of[0] if died_of else None),
                                died_of)
    timed = [i.ms for i in iterations[run.warmup:]] or [i.ms for i in iterations]
    ms = statistics.median(timed)
    peak = _PEAK.search(text)
    sizes = run.sizes
    return {"command": cmd.shell(), "data": cmd.data, "notes": cmd.notes, "mode": run.mode, "device": run.device,
            "sizes": dataclasses.asdict(sizes),
            "iterations": [i.iteration for i in iterations], "losses": [i.loss for i in iterations],
            "grad_norms": [i.grad_norm for i in iterations],
            "ms_per_iter": ms, "tokens_per_s": sizes.batch * sizes.seq / (ms / 1000), "layout": run.layout,
            "peak_memory_bytes": int(peak.group(1)) if peak else None,
            "peak_memory_kind": peak.group(2) if peak else None,
            "port_log": log.port_lines(text),
            "started": sorted({line[len(STARTED):].strip() for line in text.splitlines()
                               if line.startswith(STARTED)}),
            "substitutions": [line[len(CPU_MARK):].strip() for line in text.splitlines() if line.startswith(CPU_MARK)],
            "baseline_port_code": port_code, "deepspeed_engine": "--deepspeed" in cmd.argv}


def _entry_point(cmd: Command, run: Run) -> str:
    """The script the command's ranks run (relative to the tree)."""
    return cmd.argv[cmd.argv.index("megaport.train.launch") + 1 + (run.device == "cpu")]


def _run_nodes(cmd: Command, env: dict, timeout: float, *, forked: bool = False) -> subprocess.CompletedProcess:
    """Run the command's launchers, the other nodes' beside the first, and join their output (the
    last rank, which logs the losses, may be on any node); the first failing exit code wins.
    ``forked``: ``env`` names a preloaded server, and each launcher is torchrun forked from it."""
    launched = forked_launcher.forked_argv if forked else list
    others = [subprocess.Popen(launched(argv), cwd=cmd.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, stdin=subprocess.DEVNULL) for argv in cmd.other_nodes]
    try:
        first = subprocess.run(launched(cmd.argv), cwd=cmd.cwd, env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        outputs = [other.communicate(timeout=timeout) for other in others]
    finally:
        for other in others:
            if other.poll() is None:
                other.kill()
                other.wait()
    code = next((c for c in [first.returncode] + [o.returncode for o in others] if c), 0)
    return subprocess.CompletedProcess(cmd.argv, code, "".join([first.stdout] + [out for out, _ in outputs]),
                                       "".join([first.stderr] + [err for _, err in outputs]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, help="a Megatron-LM tree (megaport apply --dest DIR)")
    parser.add_argument("--mode", choices=MODES, default="ported")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                        help="cuda: a GPU (HIP on ROCm), under torchrun; cpu: with megaport's CPU substitutions")
    for name, value in dataclasses.asdict(GPU_SIZES).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {value} on a GPU, "
                            f"{getattr(example.Sizes(), name)} on the CPU")
    parser.add_argument("--engine", choices=deepspeed_example.ENGINES, default="deepspeed",
                        help="Megatron-DeepSpeed trees: DeepSpeed's engine (the example's --deepspeed) or "
                             "Megatron's own loop")
    parser.add_argument("--model", default="gpt", help="the model family (megaport.train.families)")
    parser.add_argument("--layout", default=layouts.ONE_RANK.name, choices=[layouts.ONE_RANK.name, *layouts.LAYOUTS],
                        help="how the run is spread over ranks and nodes (megaport.train.layouts)")
    parser.add_argument("--print-command", action="store_true",
                        help="write the run's data files (eras without --mock-data) to --workdir, print the "
                             "command and exit")
    parser.add_argument("--workdir", help="where --print-command writes data files (default: a new temporary folder)")
    args = parser.parse_args(argv)
    from megaport.train.families import registry

    family = registry.FAMILIES.get(args.model)
    if family is None:
        parser.error(f"unknown model family {args.model!r}; known: {', '.join(registry.FAMILIES)}")
    if not family.has_entry_point(args.tree):
        parser.error(f"{args.tree} has no {family.entry_point}; give a Megatron-LM tree (megaport apply --dest DIR)")
    defaults = GPU_SIZES if args.device == "cuda" else example.Sizes()
    sizes = example.Sizes(**{k: getattr(args, k) if getattr(args, k) is not None else v
                             for k, v in dataclasses.asdict(defaults).items()})
    layout = layouts.get(args.layout)
    run = Run(tree=os.path.abspath(args.tree), mode=args.mode, device=args.device, sizes=layout.sizes(sizes),
              engine=args.engine, family=args.model, layout=layout.name)
    if args.print_command:
        workdir = args.workdir or tempfile.mkdtemp(prefix="megaport-pretrain-")
        os.makedirs(workdir, exist_ok=True)
        cmd = command(run, workdir, port=29500)
        # PATH as the run has it (this interpreter's folders first: upstream's helper build calls python3)
        env = {**environment(run.tree, {}), "PATH": environment(run.tree)["PATH"],
               **{k: v for k, (v, _) in family.environment_for(run.tree).items()}, **cmd.env}
        shown = {k: env[k] for k in ("PYTHONPATH", "PATH", "CUDA_DEVICE_MAX_CONNECTIONS", deepspeed_fork.ACCELERATOR_ENV,
                                     *family.environment_for(run.tree), *cmd.env) if k in env}
        for node, argv in enumerate([cmd.argv, *cmd.other_nodes]):
            if cmd.other_nodes:
                print(f"# node {node} (start every node's command; each waits for the others at the rendezvous)")
            print(dataclasses.replace(cmd, argv=argv).shell(shown))
        return 0
    print(json.dumps(run_pretrain(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
