"""The Megatron-DeepSpeed fork's MoE: its GPT with DeepSpeed-MoE layers (``deepspeed.moe.layer.MoE``,
top-1 gating with a capacity limit and token dropping, the load-balancing loss), through the
fork's own ``pretrain_gpt.py`` and DeepSpeed's engine, with the flags of its
``examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh`` (``examples/MoE/`` before 2023-07).
One rank means an expert group of one: DeepSpeed then skips the expert all-to-all (its
``MOELayer`` calls it only where ``ep_size > 1``), so the run checks routing, capacity, the
experts and the aux loss, not the all-to-all.

The script assembles its flags in shell strings (``megatron_options="..."``, then
``megatron_options="${megatron_options} --flag"`` under ``if``): they are read with the script's
own plain assignments expanded and its ``if`` blocks decided where both sides are literals after
that (``MOE_DROP_TOKEN="true"`` so no ``--disable-moe-token-dropping``), then shrunk like every
family's. Its DeepSpeed config is the template beside it (``ds_config_gpt_TEMPLATE.json``) with
the script's own ``sed`` substitutions, and the run's batch sizes. DeepSpeed's engine is what
sets up the MoE layers' expert groups, so the run always takes it.
"""

from __future__ import annotations

import json
import math
import os
import re

from megaport.train import example
from megaport.train.families.spec import Family, entry_point_and
from megaport.train.tree_files import first_file, tree_text

SCRIPTS = ("examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh", "examples/MoE/ds_pretrain_gpt_125M_MoE64.sh")
#: the fork's parser flags the script needs (upstream's MoE says --expert-model-parallel-size)
PARSER_FLAGS = ("--moe-expert-parallel-size", "--num-experts")
#: the experts a shrunk run has (the script's 64 over a 64-rank expert group)
EXPERTS = 4
_CONFIG = "ds_config.json"
_UNRESOLVED = "megaport-unresolved:"
_SED = re.compile(r'sed\s+"s/([^/"]*)/([^/"]*)/"')
_TEST = re.compile(r'^\s*(?:el)?if\s+\[\[?\s+"?([^\s"]*)"?\s+(=|==|!=|-gt|-ge|-lt|-le|-eq|-ne)\s+"?([^\s"]*)"?\s+\]\]?\s*;\s*then\s*$')


def script_of(tree: str) -> str | None:
    """The tree's MoE example script (relative), newest layout first, or None."""
    return first_file(tree, *SCRIPTS)


def _present(tree: str) -> bool:
    return script_of(tree) is not None and entry_point_and(*PARSER_FLAGS)(tree)


_present.__doc__ = f"pretrain_gpt.py, the parser's {', '.join(PARSER_FLAGS)} and {' or '.join(SCRIPTS)}"


def _decide(left: str, op: str, right: str) -> bool | None:
    """A ``[ ... ]`` test of two literals, or None where either side is still a variable."""
    if "$" in left or "$" in right:
        return None
    if op in ("=", "=="):
        return left == right
    if op == "!=":
        return left != right
    try:
        a, b = int(left), int(right)
    except ValueError:
        return None
    return {"-gt": a > b, "-ge": a >= b, "-lt": a < b, "-le": a <= b, "-eq": a == b, "-ne": a != b}[op]


def decided(text: str) -> str:
    """``text`` (variables expanded) without the lines of ``if``/``else`` branches a literal test
    rules out; a test it cannot decide keeps every branch, as before."""
    from megaport.train.deepspeed_example import expand

    out = []
    # per open if: [this branch kept (True/False/None: undecided), a branch already taken, a test undecided]
    stack: list = []
    # a quoted literal (MOE_DROP_TOKEN="true") is a plain assignment too
    text = re.sub(r'^(\s*(?:export\s+)?\w+)="([^"$\s]*)"\s*$', r"\1=\2", text, flags=re.M)
    for line in expand(text).splitlines():
        stripped = line.strip()
        test = _TEST.match(line)
        result = _decide(*test.groups()) if test else None  # if $(ssh ...): not decided
        if re.match(r"if\b", stripped) and not re.search(r"\bfi\s*$", stripped):
            stack.append([result, bool(result), result is None])
            continue
        if stack and (re.match(r"elif\b", stripped) or stripped in ("else", "fi")):
            frame = stack[-1]
            if stripped == "fi":
                stack.pop()
            elif frame[1]:  # an earlier branch was taken: this one is not
                frame[0] = False
            elif stripped == "else":
                frame[0] = None if frame[2] else True
            else:  # elif
                frame[2] = frame[2] or result is None
                frame[0] = None if frame[2] else result
                frame[1] = bool(frame[0])
            continue
        if all(frame[0] is not False for frame in stack):
            out.append(line)
    return "\n".join(out)


def read_flags(text: str) -> list:
    """The script's flags for pretrain_gpt.py: its shell strings with its assignments expanded and
    its decidable ``if`` blocks decided (:func:`decided`), read as every family's are."""
    return example.script_flags(decided(text), quoted_strings=True)


def config(tree: str, workdir: str, run, notes: list) -> list:
    """The run's DeepSpeed config, written to ``workdir``: the template beside the script with the
    script's own ``sed`` substitutions, with the run's batch sizes (and fp16's initial loss scale
    where the run sets one: DeepSpeed's engine takes it from here, not from Megatron's
    --initial-loss-scale); the flag that passes it. ``run``: a :class:`megaport.train.pretrain.Run`."""
    sizes = run.sizes
    rel = script_of(tree)
    text = decided(tree_text(tree, rel))
    template = re.search(r'^\s*template_json="?([^"\s]+)"?\s*$', text, re.M)
    template_rel = os.path.join(os.path.dirname(rel), template.group(1) if template else "ds_config_gpt_TEMPLATE.json")
    body = tree_text(tree, template_rel)
    if body is None:
        raise FileNotFoundError(f"{template_rel}: the DeepSpeed config template {rel} names is not in the tree")
    for placeholder, value in _SED.findall(text):
        # a value the script computes in shell arithmetic (the curriculum's duration) stays a marker
        body = body.replace(placeholder, f'"{_UNRESOLVED}{placeholder}"' if "$" in value else value)
    run_config = json.loads(body)
    notes_config = []
    legacy = run_config.get("curriculum_learning")
    if isinstance(legacy, dict) and legacy.get("enabled") is False:
        # today's DeepSpeed (0.19.8 here) refuses the legacy top-level key whatever it says (its issue 8489); the
        # fork reads only its "enabled", False when the key is absent: off either way
        del run_config["curriculum_learning"]
        notes_config.append("its disabled top-level curriculum_learning left out (today's DeepSpeed refuses the legacy "
                            "key even when off; the fork reads it as off when absent)")
    if _UNRESOLVED in json.dumps(run_config):
        raise ValueError(f"{rel}: the DeepSpeed config keeps a value the script computes in shell arithmetic: "
                         f"{json.dumps(run_config)}")
    run_config.update(train_batch_size=sizes.batch, train_micro_batch_size_per_gpu=sizes.batch,
                      steps_per_print=max(int(run_config.get("steps_per_print") or 1), sizes.steps + 1),
                      wall_clock_breakdown=False)
    fp16 = run_config.get("fp16")
    if run.initial_loss_scale is not None and isinstance(fp16, dict) and fp16.get("enabled") is True:
        power = math.log2(run.initial_loss_scale)
        if power != int(power):
            raise ValueError(f"DeepSpeed's initial loss scale is a power of 2, not {run.initial_loss_scale:g}")
        notes_config.append(f"fp16's initial_scale_power {int(power)} (the run's initial loss scale; the script's "
                            f"{fp16.get('initial_scale_power')})")
        fp16["initial_scale_power"] = int(power)
    config_file = os.path.join(workdir, _CONFIG)
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(run_config, f, indent=1)
    notes.append(f"DeepSpeed config: {os.path.normpath(template_rel)} with the script's sed substitutions and the run's "
                 f"batch sizes{''.join('; ' + n for n in notes_config)}: {json.dumps(run_config, sort_keys=True)}")
    return ["--deepspeed_config", config_file]


def _sizes(sizes: example.Sizes, tree: str) -> dict:
    # the token-based schedule, over the run's tokens: decay over all of them, warmup as the
    # script's share of it (375M of 300B: less than one iteration here)
    tokens = sizes.steps * sizes.batch * sizes.seq
    return {"--num-experts": [EXPERTS], "--moe-expert-parallel-size": [1], "--train-tokens": [tokens],
            "--lr-decay-tokens": [tokens], "--lr-warmup-tokens": [max(1, tokens * 375 // 300_000)]}


FAMILY = Family(
    name="ds-moe",
    entry_point="pretrain_gpt.py",
    summary="Megatron-DeepSpeed's GPT with DeepSpeed-MoE layers (top-1 gating, capacity and token dropping)",
    scripts=SCRIPTS,
    present=_present,
    size_flags=_sizes,
    # TRAIN_ITERS is shell arithmetic ($(( ... ))), so its flag is not read: the run's iterations
    added=((("--train-iters", "1"), "the script computes its iteration count in shell arithmetic (from 300B "
                                    "tokens): the run's iterations"),),
    # a resumed run's switch: the run loads no checkpoint, and the fork's parser of 2023-07-04
    # (9e72d571, upstream's renamed --override-opt_param-scheduler) refuses the script's old name
    dropped={"--override-lr-scheduler": "it only matters when a checkpoint is loaded, and the run loads none "
                                        "(the fork's 2023-07-04 parser has no such flag)"},
    script_reader=read_flags,
    deepspeed_config=config,
    # top-1 routing and capacity dropping are discrete: rounding that sends a token elsewhere grows
    # with the step size. bdef2b01 (mds-2023-08-11) at GPT's 3e-3: ported vs unported up to 9.2e-3 in loss
    # (dense, --num-experts 1: 6.2e-5); at 1e-3: 2.8e-3, the loss still -25 % in 100 steps
    parity_learning_rate=1e-3,
    # DeepSpeed's own flags (--deepspeed) are not in the fork's arguments.py: its parser adds them
    # with deepspeed.add_config_arguments
    drop_unknown_flags=False,
)
