"""The DeepSpeed fork's own GPT example, shrunk in size only: microsoft/Megatron-DeepSpeed trees.

The fork's plain GPT pretraining script is ``run_deepspeed_example.sh`` (``examples_deepspeed/``
from 2023-08, ``examples/`` before): ``deepspeed pretrain_gpt.py`` with Megatron's flags, plus
``--deepspeed --deepspeed_config=ds_config.json --zero-stage=N ...`` from its ``ds_args`` lines,
and the DeepSpeed config the script writes with a heredoc. A run takes every flag of it (shell
variables expanded from the script's own assignments), changed as :func:`megaport.train.example.shrunk`
changes upstream's (sizes, iterations, one rank, data), with ZeRO stage 1 and a config written for
the run: the script's, with the run's batch sizes and stage.

``engine="megatron"`` leaves the DeepSpeed flags out: the same model through Megatron's own loop,
for where DeepSpeed's engine cannot run (the report says which one ran, and why).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from megaport.deepspeed_fork import is_deepspeed_tree
from megaport.train import example
from megaport.train.tree_files import first_file, tree_text

#: The fork's plain GPT example, newest layout first.
SCRIPTS = ("examples_deepspeed/run_deepspeed_example.sh", "examples/run_deepspeed_example.sh")
ENGINES = ("deepspeed", "megatron")
ZERO_STAGE = 1
#: Megatron's fp16 flag, which the script's DeepSpeed config repeats (its "fp16" block)
FP16 = "--fp16"
DESCRIBE = {"deepspeed": f"DeepSpeed's engine (--deepspeed, ZeRO stage {ZERO_STAGE})",
            "megatron": "Megatron's own training loop (the example's DeepSpeed flags left out)"}
_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=([^\s;|&]*)\s*$")
_HEREDOC = re.compile(r"<<\s*['\"]?(\w+)['\"]?\s*>\s*\S*(?:DS_CONFIG|\.json)\S*\s*\n(.*?)\n\1\s*$", re.S | re.M)


@dataclass
class ForkExample:
    """What a run of the fork's example passes and writes."""

    source: str
    tokens: list  # the script's Megatron flags (without the DeepSpeed ones)
    deepspeed: list  # the DeepSpeed flags of its ds_args lines, with the run's config and stage
    config: dict  # the DeepSpeed config the script writes, for the run
    notes: list = field(default_factory=list)


def script_path(tree: str) -> str | None:
    """The fork's GPT example script (relative), newest layout first, or None."""
    return first_file(tree, *SCRIPTS)


def expand(text: str) -> str:
    """``$VAR`` and ``${VAR}`` replaced by the script's own plain assignments (``VAR=value``), in
    order; other variables stay (their flags are then left out, as for upstream's scripts)."""
    values: dict = {}
    out = []
    for line in text.splitlines():
        line = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), line)
        match = _ASSIGNMENT.match(line)
        if match and not match.group(2).startswith(("(", "\"", "'")):
            values[match.group(1)] = match.group(2)
        out.append(line)
    return "\n".join(out)


def deepspeed_flags(text: str) -> list:
    """The flags of the script's ``ds_args="... ${ds_args}"`` lines, in the order they end up in
    (each line prepends), ``--flag=value`` split in two."""
    out = []
    for line in text.splitlines():
        match = re.match(r'^\s*ds_args="(.*)"\s*$', line)
        if not match:
            continue
        words = [w for w in match.group(1).replace("${ds_args}", " ").replace("$ds_args", " ").split() if w]
        split = []
        for word in words:
            split += word.split("=", 1) if word.startswith("--") and "=" in word else [word]
        out = split + out
    return out


def config_template(text: str) -> dict:
    """The DeepSpeed config the script writes (``cat <<EOT > $DS_CONFIG``), variables expanded."""
    match = _HEREDOC.search(text)
    if not match:
        return {}
    try:
        return json.loads(match.group(2))
    except ValueError:
        return {}


def fork_example(tree: str, workdir: str, sizes: example.Sizes, engine: str = "deepspeed", *,
                 micro_batch: int | None = None, pipeline: bool = False,
                 left_out: dict | None = None) -> ForkExample | None:
    """The fork's example for a run in ``workdir`` (its DeepSpeed config is written there), or None
    when ``tree`` is not a fork tree with the script. ``micro_batch``: a layout's micro-batch (data
    parallel ranks each take whole micro-batches of the run's global batch; DeepSpeed's config says
    both, and DeepSpeed derives gradient accumulation from them and the data-parallel ranks);
    ``pipeline``: the layout has pipeline stages, which the fork trains through DeepSpeed's
    pipeline engine (the example's ``--no-pipeline-parallel`` left out); ``left_out``: the script's
    flags the run leaves out, ``{flag: why}`` (``--fp16`` also turns the config's fp16 off)."""
    rel = script_path(tree) if is_deepspeed_tree(tree) else None
    if rel is None:
        return None
    text = expand(tree_text(tree, rel))
    # A pipe ends the command (`| tee $OUTPUT_DIR/output.log`): what follows is the log's copy.
    # The DeepSpeed flags (`$ds_args`) are read from their own lines below.
    command = "\n".join(re.sub(r"\|.*$", "", line) for line in text.splitlines() if not line.lstrip().startswith("ds_args="))
    tokens = example.script_flags(re.sub(r"\$\{?ds_args\}?", " ", command))
    notes = [f"flags of {rel} of the tree (the fork's GPT example), changed in size, iterations and data only"]
    left_out = left_out or {}
    tokens = example.without(tokens, left_out, notes)
    config = config_template(text)
    ds = deepspeed_flags(text)
    if engine == "megatron":
        notes.append(DESCRIBE["megatron"])
        if "--checkpoint-activations" in tokens and "--recompute-method" not in tokens \
                and example.parser_has(tree, "--recompute-method"):
            # Without DeepSpeed's activation checkpointing the fork's own recompute needs a method.
            tokens = tokens + ["--recompute-method", "uniform"]
            notes.append("--recompute-method uniform added: --checkpoint-activations without DeepSpeed's activation "
                         "checkpointing needs a method in this parser (uniform, what the flag meant before the rename)")
        return ForkExample(rel, tokens, [], {}, notes)
    config_file = os.path.join(workdir, "ds_config.json")
    stage_given = "--zero-stage" in ds
    out, i = [], 0
    while i < len(ds):
        flag = ds[i]
        values = []
        i += 1
        while i < len(ds) and not ds[i].startswith("--"):
            values.append(ds[i])
            i += 1
        if flag == "--deepspeed_config":
            values = [config_file]
        elif flag == "--zero-stage":
            values = [str(ZERO_STAGE)]
        elif flag == "--no-pipeline-parallel" and pipeline:
            notes.append("--no-pipeline-parallel left out: the layout's pipeline stages run on DeepSpeed's pipeline "
                         "engine (the fork's GPTModelPipe)")
            continue
        out += [flag, *values]
    if not stage_given:
        out += ["--zero-stage", str(ZERO_STAGE)]
    run_config = dict(config)
    if FP16 in left_out and run_config.get("fp16"):
        run_config["fp16"] = {**run_config["fp16"], "enabled": False}  # DeepSpeed's engine halves the model itself
    run_config.update(train_batch_size=sizes.batch, train_micro_batch_size_per_gpu=micro_batch or sizes.batch)
    run_config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": ZERO_STAGE}
    run_config["steps_per_print"] = max(int(config.get("steps_per_print", 1)), sizes.steps + 1)
    run_config["wall_clock_breakdown"] = False
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(run_config, f, indent=1)
    notes.append(f"{DESCRIBE['deepspeed']}; DeepSpeed config: the script's, with the run's batch sizes and "
                 f"stage {ZERO_STAGE}: {json.dumps(run_config, sort_keys=True)}")
    return ForkExample(rel, tokens, out, run_config, notes)


#: Where DeepSpeed's engine cannot run the tree here, not a failure of the port: what the failed run
#: printed (first match wins) and why.
_REFUSALS = (
    (re.compile(r"(ValueError: Type (?:fp16|bf16) is not supported on your device\.?)"),
     "DeepSpeed's sanity check refuses this device's precision"),
    # Not a refusal: the fork's train() of 2023-07-04..2023-07-11 taking optimizer.scale_loss, which
    # DeepSpeed's optimizers lack, is a bug of the fork's own code on every device; the series
    # before 636540a9 carry that commit's fix, and the unported baseline gets it as the listed
    # 'fork-deepspeed-train' shim, so both run DeepSpeed's engine.
)


def engine_refused(failure: str) -> str | None:
    """Why DeepSpeed's engine could not run, from a failed run's message, if that is why it failed."""
    for pattern, why in _REFUSALS:
        match = pattern.search(failure)
        if match:
            return f"{match.group(1)}: {why}"
    return None
