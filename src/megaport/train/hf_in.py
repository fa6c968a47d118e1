"""Hugging Face weights in: a model made and saved by ``transformers``, converted by upstream's own
``tools/checkpoint/convert.py`` with the command upstream's docs give (by Megatron-Bridge's import
where upstream removed the family's loader and its docs name Bridge: Llama on main since 2026-05),
and loaded by the ported tree's ``pretrain_gpt.py`` with the docs' launch flags, has the loss
``transformers`` computes on the same tokens.

What a user starting from Llama or Mixtral weights runs, in three steps, each its own process:

1. ``python -m megaport.train.hf_models FAMILY DIR`` makes the tiny model, its tokenizer, one
   64-token document, and ``transformers``' loss on it (fp32);
2. the docs' conversion command, at the target tensor-parallel size (on the CPU through megaport's
   launcher, whose substitutions serve upstream's ``torch.cuda`` calls; on a GPU as the docs run it);
3. ``pretrain_gpt.py`` on the document (upstream's indexed format), one iteration, fp32 (the docs'
   ``--bf16`` left out: the comparison is of the same numbers), at that TP (and EP) size: its first
   logged ``lm loss`` is the loss of the converted weights before any update.

What differs between families (loader, the docs' flags, the tiny model's sizes the docs give for
their own model, the parallel layouts, where the row departs from the docs and why) is the family's
:class:`Source` row; the tiny model is ``hf_models.MODELS`` / ``hf_models.SIZES``.

The losses must agree to :data:`TOLERANCE` (Megatron logs 7 digits). Families are rows of
:data:`SOURCES`; a tree without the family's loader is listed with why, never a skip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

from megaport.train import data, example, log, pretrain, torchrun, tree_files

#: relative difference allowed between Megatron's loss and transformers': fp32 on both sides, the
#: same weights; what is left is the order of floating-point sums (measured 0 on core 0.17, Llama)
TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Source:
    """One family's way in from Hugging Face, as the tree's docs give it."""

    family: str
    #: the loader module the docs' command names, under tools/checkpoint
    loader: str
    #: the docs' conversion flags, less the folders, the saver and the parallel sizes
    convert_flags: tuple
    #: the docs' launch flags for the converted checkpoint, less the folders, the parallel sizes and
    #: those of :attr:`size_flags`
    launch_flags: tuple
    #: where upstream documents both
    docs: str
    #: what a tree without the loader uses instead, for the report, said where the tree holds
    #: :attr:`removed_beside` (the loader was removed, not yet written)
    elsewhere: str = ""
    #: a converter file of the eras after the loader's removal (older trees have neither)
    removed_beside: str = ""
    #: the family converts through Megatron-Bridge (:mod:`megaport.train.bridge_convert`) where the
    #: loader was removed: what upstream's docs name there
    bridge: bool = False
    #: the docs' ``--saver``; empty: the era's name for Megatron Core's format (:func:`saver`)
    saver: str = ""
    #: launch flags the docs give with their own model's sizes: the tiny model's values go there
    #: (``hf_models.SIZES``)
    size_flags: tuple = ()
    #: the (tensor, expert) parallel sizes the round trip converts to and trains at; an expert
    #: size above 1 only where the docs' command sets ``--target-expert-parallel-size``
    layouts: tuple = ((1, 1), (2, 1))
    #: why the row departs from the docs where it does, for the report and the reader
    departures: str = ""
    #: launch flags without which the converted model computes another function (its RoPE base):
    #: an era whose parser lacks one cannot bring the weights in, whatever the port does
    needs: tuple = ("--rotary-base",)


SOURCES = {s.family: s for s in (
    Source("llama", "loader_llama_mistral",
           ("--model-type", "GPT", "--loader", "llama_mistral", "--checkpoint-type", "hf", "--model-size", "llama3"),
           ("--pipeline-model-parallel-size", "1", "--tokenizer-type", "HuggingFaceTokenizer",
            "--exit-on-missing-checkpoint", "--use-checkpoint-args", "--no-load-optim", "--no-load-rng",
            "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--no-masked-softmax-fusion", "--attention-softmax-in-fp32", "--disable-bias-linear",
            "--transformer-impl", "transformer_engine", "--group-query-attention", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--rotary-base", "500000", "--rotary-percent", "1.0", "--swiglu"),
           "docs/llama_mistral.md (Llama 3.x: the conversion, then 'Launch model')",
           # Megatron-Bridge (0.5.1 … 0.6.2 and its main 067f987) imports transformer_engine unconditionally in
           # peft/lora_layers.py: the port guards that import before the module runs (rocm_port's source
           # fixes). Its docs' script is its repository's, not its wheel's: megaport.train.bridge_convert
           # makes the script's one call. Measured on main d98e8a64dd: transformers' loss to 1.3e-7, TP1 and TP2.
           elsewhere="upstream removed its Llama loader in May 2026 (39ec5ebeb4); its docs name Megatron-Bridge",
           removed_beside="tools/checkpoint/loader_core.py",  # core 0.13 on, with the Llama loader until 2026-05
           bridge=True,
           size_flags=("--num-attention-heads", "--num-query-groups")),
    Source("mixtral", "loader_mixtral_hf",
           ("--model-type", "GPT", "--loader", "loader_mixtral_hf"),
           # train_mixtral_8x7b_distributed.sh, which the README's finetuning section runs on the
           # converted checkpoint: its MODEL_ARGS, MOE_ARGS and the parallel flags but the sizes
           ("--pipeline-model-parallel-size", "1", "--use-mcore-models", "--disable-bias-linear",
            "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--untie-embeddings-and-output-weights", "--group-query-attention", "--no-masked-softmax-fusion",
            "--no-position-embedding", "--rotary-base", "1000000",
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--sequence-parallel",
            "--tokenizer-type", "HuggingFaceTokenizer", "--no-load-optim", "--no-load-rng"),
           "examples/mixtral/README.md (the conversion, then train_mixtral_8x7b_distributed.sh for finetuning)",
           saver="mcore",
           size_flags=("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                       "--num-query-groups"),
           layouts=((1, 1), (2, 1), (1, 2)),
           departures="the docs' Llama2Tokenizer reads a SentencePiece tokenizer.model, which the tiny model "
                      "(a tokenizers vocabulary of its own) has not: HuggingFaceTokenizer reads the same "
                      "vocabulary, and the data is tokenized already, so only its size counts; Megatron's "
                      "default router (top-k of the logits, then their softmax) is transformers' (softmax, "
                      "top-k, renormalised) for top-2, so no router flag is added; --bf16 left out (fp32), and with it "
                      "--moe-grouped-gemm, which upstream allows in bf16 only (its experts then run one "
                      "after another, as SequentialMLP)"),
)}


#: what trains the converted weights (step 3), Llama's and Mixtral's alike
ENTRY_POINT = "pretrain_gpt.py"


def saver(tree: str) -> str:
    """The docs' ``--saver`` for Megatron Core's format: ``core`` from core 0.13, ``mcore`` before."""
    return "core" if tree_files.first_file(tree, "tools/checkpoint/saver_core.py") else "mcore"


def absent(tree: str, family: str) -> str | None:
    """Why the tree cannot bring ``family``'s Hugging Face weights in; None where it can. Era facts,
    read from the unported commit (:mod:`megaport.train.tree_files`): a series that dropped a loader
    must fail the row, not remove it."""
    source = SOURCES[family]
    if not tree_files.first_file(tree, ENTRY_POINT):
        # the nano-v3-vl snapshot (2026-04-21) kept the converter but not the entry points, nor the
        # model_provider.py its saver imports
        return f"the tree has no {ENTRY_POINT}, which trains the converted weights (a branch without the entry points)"
    if through_bridge(tree, family):
        return None
    if not tree_files.first_file(tree, f"tools/checkpoint/{source.loader}.py"):
        removed = source.elsewhere and tree_files.first_file(tree, source.removed_beside)
        return f"the tree has no tools/checkpoint/{source.loader}.py" + (f": {source.elsewhere}" if removed else
                                                                        " (this era's converter has none)")
    missing = [flag for flag in source.needs if not example.parser_has(tree, flag)]
    if missing:
        # main 2024-06-04 … 06-27: the Llama 3 converter came before the parser had --rotary-base
        # (3da17a326f), so the model ran RoPE at base 10000 (2.9 % off transformers' loss)
        return f"the era's parser has no {', '.join(missing)}, which the {family} model needs (its RoPE base)"
    return None


def through_bridge(tree: str, family: str) -> bool:
    """Whether ``family``'s weights come in through Megatron-Bridge on ``tree``: upstream removed the
    loader there (the era has the converter's later files, not the loader) and its docs name Bridge."""
    source = SOURCES[family]
    return (source.bridge and not tree_files.first_file(tree, f"tools/checkpoint/{source.loader}.py")
            and tree_files.first_file(tree, source.removed_beside) is not None)


#: what the round trip imports: module -> the package ``pip install`` takes
PACKAGES = {"transformers": "transformers", "accelerate": "accelerate", "tokenizers": "tokenizers"}
#: and, where the weights come in through Megatron-Bridge, Bridge
BRIDGE_PACKAGES = {"megatron.bridge": "megatron-bridge"}


def missing_packages(python: str = sys.executable, bridge: bool = False, env: dict | None = None) -> list:
    """What the round trip imports that ``python`` lacks (the packages to install): transformers (the
    model and the converter's loader), accelerate (the loader's ``device_map='cpu'``), and with
    ``bridge`` Megatron-Bridge."""
    wanted = {**PACKAGES, **(BRIDGE_PACKAGES if bridge else {})}
    probe = ("import importlib.util, json, sys\n"
             "def lacks(m):\n"
             "    try:\n        return importlib.util.find_spec(m) is None\n"
             "    except ImportError:\n        return True\n"
             "print(json.dumps([m for m in sys.argv[1:] if lacks(m)]))")
    proc = subprocess.run([python, "-c", probe, *wanted], capture_output=True, text=True, timeout=120, env=env)
    lacking = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else ["transformers"]
    return [wanted[m] for m in lacking]


def _run(argv: list, cwd: str, env: dict, what: str, timeout: float = 900) -> str:
    """Run one step; its output, or RuntimeError naming the step and, in the rank's own words
    (:func:`log.failure_message`), why it failed."""
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(log.failure_message(proc.returncode, proc.stdout, proc.stderr, 0, lines=15, entry_point=what)
                           .replace(" after 0 logged iterations", "", 1))
    return proc.stdout + "\n" + proc.stderr


def make_model(family: str, folder: str, env: dict) -> dict:
    """The family's tiny Hugging Face model in ``folder`` (step 1): its document and loss."""
    text = _run([sys.executable, "-m", "megaport.train.hf_models", family, folder], folder, env,
                f"making a tiny {family} with transformers")
    return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith('{"document"')))


#: the loader's --model-size for a Llama 3 before core 0.9 named it by size (docs: llama3-8B)
_SIZED_NAMES = {"llama3": "llama3-8B"}


def _era_model_size(tree: str, source: Source, flag: str) -> str:
    """``flag``, or the name the tree's loader gives the same model where it names models by size."""
    if flag not in _SIZED_NAMES:
        return flag
    text = tree_files.tree_text(tree, f"tools/checkpoint/{source.loader}.py") or ""
    return flag if f"'{flag}'" in text or not text else _SIZED_NAMES[flag]


def layout_name(tp: int, ep: int = 1) -> str:
    """How the report names a layout: ``tp2``, ``tp1-ep2``."""
    return f"tp{tp}" + (f"-ep{ep}" if ep > 1 else "")


def convert_command(tree: str, family: str, hf: str, out: str, tp: int, gpu: bool, ep: int = 1) -> list:
    """The docs' conversion command (step 2); on the CPU through megaport's launcher. Through
    Megatron-Bridge (:func:`through_bridge`) the docs' import takes no parallel sizes: it writes one
    rank's checkpoint, which the launch reshards (``torch_dist``)."""
    source = SOURCES[family]
    if through_bridge(tree, family):
        from megaport.train import bridge_convert

        script = bridge_convert.__file__
        start = [sys.executable, script] if gpu else [sys.executable, "-m", "megaport.train.launch", "--cpu", script]
        return start + ["import", "--hf-model", hf, "--megatron-path", out, "--torch-dtype", "float32",
                        *(["--device-map", "auto"] if gpu else [])]
    script = os.path.join("tools", "checkpoint", "convert.py")
    flags = [_era_model_size(tree, source, flag) for flag in source.convert_flags]
    start = [sys.executable, script] if gpu else [sys.executable, "-m", "megaport.train.launch", "--cpu", script]
    expert = ["--target-expert-parallel-size", str(ep)] if any(e > 1 for _, e in source.layouts) else []
    return start + flags + [
        "--saver", source.saver or saver(tree), "--load-dir", hf, "--save-dir", out, "--tokenizer-model", hf,
        "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", "1", *expert]


def launch_command(family: str, hf: str, checkpoint: str, prefix: str, tp: int, gpu: bool, ep: int = 1,
                   bridge: bool = False) -> list:
    """The docs' launch flags for the converted checkpoint (step 3), one fp32 iteration on the document.
    A Megatron-Bridge checkpoint stores no Megatron-LM arguments for ``--use-checkpoint-args`` to
    read: every shape flag of the model is given (``bridge``)."""
    from megaport.train import hf_models

    source = SOURCES[family]
    shape = hf_models.SIZES[family] if bridge else source.size_flags
    sizes = [str(item) for flag in shape for item in (flag, hf_models.SIZES[family][flag])]
    expert = ["--expert-model-parallel-size", str(ep)] if any(e > 1 for _, e in source.layouts) else []
    target = ["-m", "megaport.train.launch", *([] if gpu else ["--cpu"]), ENTRY_POINT,
              "--tensor-model-parallel-size", str(tp), *expert, *source.launch_flags, *sizes,
              "--tokenizer-model", hf, "--load", checkpoint,
              "--seq-length", str(hf_models.SEQ), "--max-position-embeddings", str(hf_models.POSITIONS),
              "--finetune", "--micro-batch-size", "1", "--global-batch-size", str(ep), "--train-iters", "1",
              "--lr", "1e-6", "--min-lr", "0", "--data-path", prefix, "--split", "100,0,0",
              "--log-interval", "1", "--eval-interval", "1", "--eval-iters", "0"]
    return torchrun.node_commands(torchrun.Ranks(tp * ep), target)[0]


def round_trip(tree: str, family: str, tp: int, workdir: str, env: dict | None = None, gpu: bool = False,
               ep: int = 1) -> dict:
    """Steps 1-3 for ``family`` at TP ``tp`` and EP ``ep`` in ``workdir``: the losses, their
    difference, the commands and ``problems`` (empty when Megatron's loss is transformers')."""
    # The model is made, and converted, by processes that import transformers before any Megatron
    # module (the converter's loader does): whatever transformers then imports (DeepSpeed, which
    # imports apex) is the user's, not the ported tree's, so verify's apex stand-ins stay out of
    # them and guard the training run alone.
    run_env, tool_env = pretrain.environment(tree, env), pretrain.environment(tree)
    hf = os.path.join(workdir, f"hf-{family}")
    if not os.path.exists(os.path.join(hf, "made.json")):
        os.makedirs(hf, exist_ok=True)
        made = make_model(family, hf, tool_env)
        with open(os.path.join(hf, "made.json"), "w") as handle:
            json.dump(made, handle)
    with open(os.path.join(hf, "made.json")) as handle:
        made = json.load(handle)
    prefix = os.path.join(workdir, f"document-{family}")
    data.write_indexed_dataset(prefix, [made["document"]])
    bridge = through_bridge(tree, family)
    checkpoint = os.path.join(workdir, f"converted-{family}-" + ("bridge" if bridge else layout_name(tp, ep)))
    convert = convert_command(tree, family, hf, checkpoint, tp, gpu, ep)
    done = os.path.exists(os.path.join(checkpoint, "latest_checkpointed_iteration.txt"))
    converter = "Megatron-Bridge's import" if bridge else "upstream's converter"
    converted = "" if bridge and done else _run(convert, tree, tool_env, converter)
    if not os.path.exists(os.path.join(checkpoint, "latest_checkpointed_iteration.txt")):
        # convert.py exits 0 when its loader or saver process dies: what they said is the cause
        errors = [line for line in converted.splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
        raise RuntimeError(f"{converter} wrote no checkpoint in {checkpoint}"
                           + (f": {errors[-1].strip()}" if errors else ""))
    launch = launch_command(family, hf, checkpoint, prefix, tp, gpu, ep, bridge=bridge)
    trained = log.parse_log(_run(launch, tree, run_env, f"{ENTRY_POINT} on the converted checkpoint"))
    if not trained:
        raise RuntimeError(f"{ENTRY_POINT} logged no iteration on the converted checkpoint")
    loss, reference = trained[0].loss, made["loss"]
    difference = abs(loss - reference) / abs(reference)
    problems = [] if difference <= TOLERANCE else [
        f"Megatron's loss on the converted weights is {loss:.6f}, transformers' {reference:.6f} "
        f"({difference:.1e} apart, at most {TOLERANCE:.0e})"]
    return {"loss": loss, "transformers_loss": reference, "relative_difference": difference, "problems": problems,
            "transformers": made["transformers"], "tp": tp, "ep": ep, "docs": SOURCES[family].docs,
            "converter": "Megatron-Bridge's import (AutoBridge.import_ckpt, one rank's checkpoint)" if bridge
            else "upstream's tools/checkpoint/convert.py",
            "convert_command": " ".join(convert), "launch_command": " ".join(launch),
            "port_log": log.port_lines(converted)}
