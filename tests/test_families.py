"""Model families (megaport.train.families): the registry, each family's presence rule, its flags
from a tree's script or its fallback set, shrunk to the run's sizes, the WordPiece data BERT and
T5 train on, and verify's --model choice (fake trees: seconds; the real trees are trained by
test_families_fullclone.py and verify's smoke suite)."""

from __future__ import annotations

import dataclasses
import struct
import sys
from pathlib import Path

import pytest

from megaport.errors import MegaportError
from megaport.train import example, pretrain, vocab_order, wordpiece
from megaport.train.families import registry
from megaport.train.families.spec import Family

ALL = ["gpt", "bert", "t5", "llama", "llama3", "mixtral", "deepseek", "ds-moe", "megablocks-moe"]
# the architecture flags the non-GPT families' presence rules read in the era's parser
PARSER = """
add('--normalization'); add('--swiglu'); add('--group-query-attention'); add('--disable-bias-linear')
add('--untie-embeddings-and-output-weights'); add('--no-position-embedding'); add('--num-experts')
add('--moe-router-topk'); add('--multi-latent-attention'); add('--mock-data'); add('--num-query-groups')
add('--ffn-hidden-size'); add('--kv-channels')
"""
BERT_2024 = """#!/bin/bash
VOCAB_FILE=$3 #<Specify path to file>/bert-vocab.json
BERT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --fp16
    --lr 0.0001
)
DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_bert.py ${BERT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DATA_ARGS[@]}
"""
# T5's 2024 script: a quoted multi-line string whose closing quote follows a continuation
T5_2024 = """#!/bin/bash
T5_ARGS="
    --encoder-num-layers 12 \\
    --decoder-num-layers 12 \\
    --hidden-size 768 \\
    --num-attention-heads 12 \\
    --kv-channels 64 \\
    --ffn-hidden-size 3072 \\
    --encoder-seq-length 512 \\
    --decoder-seq-length 128 \\
    --bf16 \\
    --vocab-extra-ids 100 \\
    --attention-backend auto \\
"
DATA_ARGS="
    --data-path $DATA_PATH \\
    --tokenizer-type BertWordPieceCase \\
    --split 99982,9,9 \\
"
torchrun $DISTRIBUTED_ARGS pretrain_t5.py $T5_ARGS $DATA_ARGS
"""


def make_tree(root: Path, *, entry_points=("pretrain_gpt.py",), parser: str = "", scripts: dict | None = None) -> str:
    (root / "megatron").mkdir(parents=True)
    (root / "megatron/arguments.py").write_text(parser)
    for name in entry_points:
        (root / name).write_text("")
    for rel, text in (scripts or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root)


def test_the_registry_holds_one_spec_per_family_module():
    assert list(registry.FAMILIES) == ALL
    assert all(isinstance(f, Family) and f.name == name for name, f in registry.FAMILIES.items())
    assert registry.get("bert").entry_point == "pretrain_bert.py"
    assert registry.get("t5").entry_point == "pretrain_t5.py"
    assert {registry.get(n).entry_point for n in ("gpt", "llama", "llama3", "mixtral", "deepseek", "ds-moe",
                                                  "megablocks-moe")} == \
        {"pretrain_gpt.py"}


def test_an_unknown_family_is_a_one_line_error_naming_the_known_ones():
    with pytest.raises(MegaportError) as error:
        registry.get("gpt4")
    message = str(error.value)
    assert "\n" not in message and "'gpt4'" in message and all(name in message for name in ALL)
    assert error.value.exit_code == 2


@pytest.mark.parametrize("entry_points, parser, expected", [
    # PyPI's megatron-core: no entry point at all, GPT through the harness
    ((), "", ["gpt"]),
    # 2022: GPT, BERT and T5 scripts, a parser without RMSNorm or MoE
    (("pretrain_gpt.py", "pretrain_bert.py", "pretrain_t5.py"), "add('--num-layers')", ["gpt", "bert", "t5"]),
    # 2024-2026: all of them but llama3 (no Llama 3 script here)
    (("pretrain_gpt.py", "pretrain_bert.py", "pretrain_t5.py"), PARSER, ["gpt", "bert", "t5", "llama", "mixtral",
                                                                          "deepseek"]),
    # main after 2026-05: BERT and T5 gone
    (("pretrain_gpt.py",), PARSER, ["gpt", "llama", "mixtral", "deepseek"]),
])
def test_each_tree_has_the_families_its_entry_points_and_parser_allow(tmp_path, entry_points, parser, expected):
    tree = make_tree(tmp_path, entry_points=entry_points, parser=parser)
    assert [f.name for f in registry.families_for(tree)] == expected


def test_stanfords_megablocks_moe_is_present_with_its_adapter_and_parser_flag(tmp_path):
    stanford = make_tree(tmp_path / "stanford", entry_points=("pretrain_gpt.py", "pretrain_bert.py", "pretrain_t5.py"),
                         parser="add('--moe-num-experts'); add('--moe-capacity-factor'); add('--moe-top-k')",
                         scripts={"megatron/model/megablocks_utils.py": "import megablocks\n"})
    assert [f.name for f in registry.families_for(stanford)] == ["gpt", "bert", "t5", "megablocks-moe"]
    no_adapter = make_tree(tmp_path / "upstream", parser="add('--moe-num-experts')")
    assert "megablocks-moe" not in [f.name for f in registry.families_for(no_adapter)]


def test_megablocks_moe_runs_megablocks_script_flags_shrunk_to_four_experts(tmp_path):
    """MegaBlocks' exp/moe script's MoE, model and compute flags, shrunk like every family's, with
    four experts; a flag the era's parser lacks is left out."""
    parser = "".join(f"add('{f}')\n" for f in (
        "--moe-num-experts", "--moe-capacity-factor", "--moe-loss-weight", "--moe-top-k", "--fp16", "--DDP-impl",
        "--moe-expert-model-parallelism", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
        "--max-position-embeddings", "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr",
        "--lr-decay-iters", "--min-lr", "--lr-decay-style", "--lr-warmup-fraction", "--clip-grad",
        "--init-method-std"))
    tree = make_tree(tmp_path, parser=parser, scripts={"megatron/model/megablocks_utils.py": ""})
    family = registry.get("megablocks-moe")
    assert family.needs == ("megablocks",)
    notes: list = []
    tokens, source = family.flags(tree)
    assert "exp/moe/moe_46m_8gpu.sh" in source
    kept = pretrain._family_flags(family, tokens, tree, notes)
    flags = example.shrunk(kept, example.Sizes(), data=[], tree=tree, notes=notes,
                           more_sizes=family.size_flags(example.Sizes(), tree))
    assert example.flag_value(flags, "--moe-num-experts") == "4"
    assert example.flag_value(flags, "--moe-capacity-factor") == "16384"
    assert "--fp16" in flags and "--moe-expert-model-parallelism" in flags
    assert "--no-async-tensor-model-parallel-allreduce" not in flags  # not in this parser
    assert any("--no-async-tensor-model-parallel-allreduce left out" in n for n in notes)


def test_a_familys_needed_package_is_looked_up_in_the_interpreter_that_will_run_it(tmp_path):
    """``bench --train --python OTHER`` runs the family in OTHER: a package only OTHER has is not
    missing, and one only this interpreter has is."""
    other_site = tmp_path / "site"
    (other_site / "only_there").mkdir(parents=True)
    (other_site / "only_there" / "__init__.py").write_text("")
    other = tmp_path / "python"
    other.write_text(f"#!/bin/sh\nPYTHONPATH={other_site} exec {sys.executable} \"$@\"\n")
    other.chmod(0o755)
    family = dataclasses.replace(registry.get("megablocks-moe"), needs=("only_there", "pytest"))
    assert family.missing_packages() == ["only_there"]
    assert family.missing_packages(str(other)) == []
    assert dataclasses.replace(family, needs=("only_there", "not_anywhere_xyz")).missing_packages(str(other)) == [
        "not_anywhere_xyz"]


def test_llama3_is_present_where_the_tree_has_its_script(tmp_path):
    tree = make_tree(tmp_path, parser=PARSER, scripts={"examples/llama/train_llama3_8b_h100_fp8.sh": "#!/bin/bash\n"})
    assert "llama3" in [f.name for f in registry.families_for(tree)]


def test_model_selection_checks_names_and_the_tree(tmp_path):
    tree = make_tree(tmp_path, entry_points=("pretrain_gpt.py", "pretrain_bert.py"))
    assert [f.name for f in registry.select(tree, None)] == ["gpt", "bert"]
    assert [f.name for f in registry.select(tree, "bert, gpt,bert")] == ["bert", "gpt"]
    with pytest.raises(MegaportError, match=r"unknown model family 'bret'; known: gpt, bert"):
        registry.select(tree, "gpt,bret")
    with pytest.raises(MegaportError) as error:
        registry.select(tree, "t5")
    assert "has no t5" in str(error.value) and "\n" not in str(error.value) and error.value.exit_code == 2


def test_a_family_reads_the_newest_script_the_tree_has_else_its_fallback(tmp_path):
    bert = registry.get("bert")
    old = make_tree(tmp_path / "old", entry_points=("pretrain_bert.py",))
    tokens, source = bert.flags(old)
    assert source.startswith("examples/pretrain_bert.sh as of") and example.flag_value(tokens, "--num-layers") == "24"
    new = make_tree(tmp_path / "new", entry_points=("pretrain_bert.py",),
                    scripts={"examples/bert/train_bert_340m_distributed.sh": BERT_2024,
                             "examples/pretrain_bert.sh": "python pretrain_bert.py --num-layers 3\n"})
    tokens, source = bert.flags(new)
    assert source == "examples/bert/train_bert_340m_distributed.sh of the tree"
    assert tokens == ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length",
                      "512", "--max-position-embeddings", "512", "--micro-batch-size", "4", "--fp16", "--lr", "0.0001"]


def test_t5s_quoted_multi_line_arguments_are_read_to_their_end(tmp_path):
    tree = make_tree(tmp_path, entry_points=("pretrain_t5.py",), scripts={"examples/t5/train_t5_220m_distributed.sh": T5_2024})
    tokens, _ = registry.get("t5").flags(tree)
    assert example.flag_value(tokens, "--attention-backend") == "auto"
    assert example.flag_value(tokens, "--tokenizer-type") == "BertWordPieceCase"
    # GPT's reader stays as it was: the last line of such a string is not read
    assert "--attention-backend" not in example.script_flags(T5_2024)


def test_t5_runs_with_its_own_size_flags_and_wordpiece_data(tmp_path):
    tree = make_tree(tmp_path / "tree", entry_points=("pretrain_t5.py",),
                     parser="add('--encoder-num-layers'); add('--decoder-num-layers'); add('--kv-channels'); "
                            "add('--ffn-hidden-size'); add('--encoder-seq-length'); add('--decoder-seq-length'); "
                            "add('--vocab-extra-ids'); add('--hidden-size'); add('--num-attention-heads'); "
                            "add('--max-position-embeddings'); add('--bf16'); add('--data-path'); add('--tokenizer-type')",
                     scripts={"examples/t5/train_t5_220m_distributed.sh": T5_2024})
    sizes = example.Sizes(layers=2, hidden=64, heads=4, seq=64, steps=5)
    work = tmp_path / "work"
    work.mkdir()
    argv = pretrain.command(pretrain.Run(tree=tree, sizes=sizes, family="t5"), str(work)).argv
    entry = argv.index("pretrain_t5.py")
    flags = argv[entry + 1:]
    value = lambda flag: flags[flags.index(flag) + 1]  # noqa: E731
    assert (value("--encoder-num-layers"), value("--decoder-num-layers"), value("--kv-channels"),
            value("--ffn-hidden-size"), value("--encoder-seq-length"), value("--decoder-seq-length")) == \
        ("2", "2", "16", "256", "64", "32")
    assert value("--tokenizer-type") == "BertWordPieceCase"  # the script's, kept
    assert Path(value("--vocab-file")).read_text().splitlines()[:5] == list(wordpiece.SPECIALS)
    assert "--attention-backend" not in flags  # this parser lacks it: left out, and said
    notes = pretrain.command(pretrain.Run(tree=tree, sizes=sizes, family="t5"), str(work)).notes
    assert any(n.startswith("--attention-backend left out") for n in notes)


# core 0.17's tokenizer map (megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py), in part
_HF_TOKENIZER_MAP = """
MEGATRON_CONFIG_MAP = {
    "BertWordPieceLowerCase": {
        "vocab": "https://s3.amazonaws.com/models.huggingface.co/bert/bert-large-uncased-vocab.txt",
        "tokenizer_name": "bert-large-uncased",
    },
    "BertWordPieceCase": {
        "vocab": "https://s3.amazonaws.com/models.huggingface.co/bert/bert-large-cased-vocab.txt",
        "tokenizer_name": "bert-large-cased",
    },
}
"""


def test_a_tokenizer_system_that_loads_bert_from_the_hub_reads_the_runs_vocabulary_offline(tmp_path):
    tree = make_tree(tmp_path / "tree", entry_points=("pretrain_t5.py",),
                     parser="add('--data-path'); add('--tokenizer-type'); add('--vocab-file')",
                     scripts={"examples/t5/train_t5_220m_distributed.sh": T5_2024,
                              "megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py": _HF_TOKENIZER_MAP})
    assert wordpiece.hub_tokenizer_name(tree, "BertWordPieceCase") == "bert-large-cased"
    assert wordpiece.hub_tokenizer_name(tree, "GPT2BPETokenizer") is None
    work = tmp_path / "work"
    work.mkdir()
    cmd = pretrain.command(pretrain.Run(tree=tree, sizes=example.Sizes(steps=3, seq=64), family="t5"), str(work))
    assert cmd.env["HF_HUB_OFFLINE"] == "1"
    model = Path(cmd.env["HF_HOME"]) / "hub" / "models--bert-large-cased"
    snapshot = model / "snapshots" / (model / "refs" / "main").read_text()
    flags = cmd.argv
    assert (snapshot / "vocab.txt").read_text() == Path(flags[flags.index("--vocab-file") + 1]).read_text()
    assert '"do_lower_case": false' in (snapshot / "tokenizer_config.json").read_text()
    assert any("bert-large-cased" in n and "offline" in n for n in cmd.notes)
    assert cmd.env[vocab_order.ENV] == "1"  # both runs see the hub tokenizer's vocabulary in one order
    assert any("sorted by id" in n for n in cmd.notes)
    # a tree whose tokenizer reads the vocabulary file alone gets no such environment
    plain = make_tree(tmp_path / "plain", entry_points=("pretrain_t5.py",), parser="add('--data-path')",
                      scripts={"examples/t5/train_t5_220m_distributed.sh": T5_2024})
    assert pretrain.command(pretrain.Run(tree=plain, sizes=example.Sizes(steps=3, seq=64), family="t5"),
                            str(work)).env == {}


def test_gpt_commands_are_unchanged_by_families(tmp_path):
    """GPT's run is the Run default: the same argv and notes whether or not the family is named."""
    from test_train import COMMAND_LINE

    tree = make_tree(tmp_path / "tree", parser="group.add_argument('--data-path', nargs='*')\n",
                     scripts={"examples/pretrain_gpt.sh": COMMAND_LINE})
    run = pretrain.Run(tree=tree, sizes=example.Sizes(steps=4, seq=32, batch=2))
    a = pretrain.command(run, str(tmp_path), port=1)
    b = pretrain.command(dataclasses.replace(run, family="gpt"), str(tmp_path), port=1)
    assert a.argv == b.argv and a.notes == b.notes and a.argv[a.argv.index("--cpu") + 1] == "pretrain_gpt.py"
    assert a.notes[0] == "flags of examples/pretrain_gpt.sh of the tree, changed in size, iterations and data only"
    assert "--DDP-impl" in a.argv  # GPT keeps flags its parser's text does not name, as before


@pytest.mark.parametrize("name", ["llama", "mixtral", "deepseek"])
def test_decoder_families_shrink_every_size_they_carry(tmp_path, name):
    tree = make_tree(tmp_path / "tree", parser=PARSER + "add('--moe-ffn-hidden-size'); add('--kv-lora-rank')")
    family = registry.get(name)
    sizes = example.Sizes()
    tokens, _ = family.flags(tree) if family.fallback else ([], "")
    if not tokens:  # deepseek has no fallback: its flags come from the tree's conf file only
        tokens = ["--num-layers", "27", "--hidden-size", "2048", "--ffn-hidden-size", "10944", "--num-experts", "64",
                  "--moe-ffn-hidden-size", "1408", "--kv-lora-rank", "512", "--moe-layer-freq", "([0]+[1]*26)"]
    flags = example.shrunk(tokens, sizes, data=[], tree=tree, more_sizes=family.size_flags(sizes, tree))
    big = [(f, v) for f, v in example.group_flags(flags) if v and v[0].isdigit() and int(float(v[0])) > 1000
           and f not in ("--rotary-base",)]
    assert not big, big
    if name == "deepseek":
        assert example.flag_value(flags, "--moe-layer-freq") == "[0]+[1]*1"


def test_wordpiece_documents_are_sentences_with_document_boundaries(tmp_path):
    docs = wordpiece.sentence_documents(5, wordpiece.WORDS, seed=1)
    assert all(4 <= len(doc) <= 8 for doc in docs)
    ids = [t for doc in docs for s in doc for t in s]
    assert min(ids) >= len(wordpiece.SPECIALS) and max(ids) < len(wordpiece.SPECIALS) + wordpiece.WORDS
    prefix = str(tmp_path / "d")
    from megaport.train.data import write_indexed_dataset

    write_indexed_dataset(prefix, docs, sentences=True)
    raw = Path(prefix + ".idx").read_bytes()
    sequences, boundaries = struct.unpack_from("<QQ", raw, 18)
    assert sequences == sum(len(d) for d in docs) and boundaries == len(docs) + 1
    offset = 34 + 4 * sequences + 8 * sequences
    assert list(struct.unpack_from(f"<{boundaries}q", raw, offset))[-1] == sequences


LLAMA3 = """#!/bin/bash
DTYPE="fp8"
MODEL_ARGS=(
    --num-layers $NUM_LAYERS
    --hidden-size 4096
    --apply-layernorm-1p
)
TRAINING_ARGS=(
    --train-samples 1953125000
    --profile
    --bf16
)
DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        "--fp8-format hybrid"
        "--fp8-param-gather"
    )
fi
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DTYPE_ARGS[@]}
"""


def test_llama3_keeps_its_script_but_the_sample_schedule_and_profiling(tmp_path):
    tree = make_tree(tmp_path / "tree", parser=PARSER + "add('--apply-layernorm-1p'); add('--fp8-format'); "
                     "add('--fp8-param-gather'); add('--hidden-size'); add('--bf16'); add('--train-iters'); "
                     "add('--num-layers'); add('--seq-length'); add('--max-position-embeddings'); "
                     "add('--micro-batch-size'); add('--lr-decay-iters')",
                     scripts={"examples/llama/train_llama3_8b_h100_fp8.sh": LLAMA3})
    family = registry.get("llama3")
    tokens, source = family.flags(tree)
    assert tokens[tokens.index("--fp8-format") + 1] == "hybrid"  # a quoted "--flag value" is both
    notes: list = []
    from megaport.train.pretrain import _family_flags

    kept = _family_flags(family, tokens, tree, notes)
    assert "--apply-layernorm-1p" in kept and "--fp8-param-gather" in kept and "--bf16" in kept
    assert "--train-samples" not in kept and "--profile" not in kept
    assert example.flag_value(kept, "--train-iters") == "1"  # added, then shrunk to the run's
    assert any(n.startswith("--train-samples left out (a sample-based schedule") for n in notes)
    assert any(n.startswith("--num-layers") and "added" in n for n in notes)


def test_t5_gives_the_decoder_depth_where_the_parser_takes_it_apart(tmp_path):
    from megaport.train.pretrain import _family_flags

    t5 = registry.get("t5")
    tokens = ["--num-layers", "12", "--hidden-size", "768"]
    apart = make_tree(tmp_path / "apart", entry_points=("pretrain_t5.py",),
                      parser="add('--num-layers'); add('--hidden-size'); add('--decoder-num-layers')")
    notes: list = []
    flags = example.shrunk(_family_flags(t5, tokens, apart, notes), example.Sizes(layers=2), data=[], tree=apart,
                           more_sizes=t5.size_flags(example.Sizes(layers=2), apart))
    assert example.flag_value(flags, "--decoder-num-layers") == "2" and "added" in notes[0]
    together = make_tree(tmp_path / "together", entry_points=("pretrain_t5.py",),
                         parser="add('--num-layers'); add('--hidden-size')")
    notes = []
    assert "--decoder-num-layers" not in _family_flags(t5, tokens, together, notes) and notes == []


def test_loss_parity_trains_t5_at_its_own_stable_rate(tmp_path):
    """T5 at GPT's parity rate (3e-3) spikes (grad norm 0.3 → 18 in ten steps, core_v0.16.1) and
    rounding apart grows past 1 %; parity trains it at 5e-4, GPT keeps 3e-3."""
    from megaport.train import parity

    tree = make_tree(tmp_path / "tree", entry_points=("pretrain_gpt.py", "pretrain_t5.py"),
                     scripts={"examples/t5/train_t5_220m_distributed.sh": T5_2024})
    assert parity.parity_run(tree, family="t5").lr == 5e-4
    # the fork's MoE too: its discrete routing amplifies rounding with the step size
    assert parity.parity_run(ds_moe_tree(tmp_path / "fork"), family="ds-moe").lr == 1e-3
    moe = make_tree(tmp_path / "moe", parser=PARSER)
    assert parity.parity_run(moe, family="mixtral").lr == 1e-3
    assert parity.parity_run(tree, family="gpt").lr == example.PARITY_LEARNING_RATE


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_query_groups_shrink_to_one_where_upstreams_legacy_gqa_view_refuses_more(tmp_path, name):
    """Upstream's legacy transformer (2023-09 … the legacy models' removal) views a split QKV's query
    in one go: more than one group per tensor-parallel rank fails in upstream itself."""
    from megaport.train.families import spec

    legacy = {"megatron/model/transformer.py": f"            {spec._LEGACY_GQA_VIEW}\n"}
    family, sizes = registry.get(name), example.Sizes(heads=4)
    groups = lambda tree: family.size_flags(sizes, tree)["--num-query-groups"]  # noqa: E731
    assert groups(make_tree(tmp_path / "legacy-only", parser=PARSER, scripts=legacy)) == [1]
    assert groups(make_tree(tmp_path / "mcore-opt-in", parser=PARSER + "add('--use-mcore-models')",
                            scripts=legacy)) == [1]
    assert groups(make_tree(tmp_path / "mcore-default", parser=PARSER + "add('--use-legacy-models')",
                            scripts=legacy)) == [2]
    assert groups(make_tree(tmp_path / "no-legacy", parser=PARSER)) == [2]


# Megatron-DeepSpeed's examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh, cut down: its flags are
# shell strings built from assignments (some quoted, some shell arithmetic) and appended under if
DS_MOE = """#!/bin/bash
DIR=`pwd`
SEQ_LEN=2048
NUM_LAYERS=12
HIDDEN_SIZE=768
GLOBAL_BATCH_SIZE=256
TRAIN_TOKENS=300000000000
TRAIN_ITERS=$(( ${TRAIN_TOKENS} * 3 / ${GLOBAL_BATCH_SIZE} / ${SEQ_LEN} ))
WARMUP_TOKENS=375000000
LR_DECAY_TOKENS=300000000000
BATCH_SIZE=4
NUM_GPUS=$(($(ds_ssh nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)-2))
EP_SIZE=64
if [[ $EP_SIZE -gt $NUM_GPUS ]]; then
    EP_PARALLEL_SIZE=$NUM_GPUS
else
    EP_PARALLEL_SIZE=$EP_SIZE
fi
LR=4.5e-4
MOE_DROP_TOKEN="true"
CL_ENABLED="false"
CL_START_SEQLEN=80
CL_STEP=$(( ${TRAIN_TOKENS} / 7 ))
ACTIVATION_CHECKPOINT="true"
megatron_options=" \\
        --override-opt_param-scheduler \\
        --moe-expert-parallel-size ${EP_PARALLEL_SIZE} \\
        --num-experts ${EP_SIZE} \\
        --moe-min-capacity 4 \\
        --lr-decay-tokens ${LR_DECAY_TOKENS} \\
        --lr-warmup-tokens ${WARMUP_TOKENS} \\
        --micro-batch-size ${BATCH_SIZE} \\
        --num-layers ${NUM_LAYERS} \\
        --hidden-size ${HIDDEN_SIZE} \\
        --train-tokens ${TRAIN_TOKENS} \\
        --train-iters ${TRAIN_ITERS} \\
        --lr ${LR} \\
        --fp16 \\
        --load ${CHECKPOINT_PATH}"
if [ "${ACTIVATION_CHECKPOINT}" = "true" ]; then
megatron_options="${megatron_options} \\
        --checkpoint-activations"
fi
if [[ $EP_SIZE -gt 1 ]]; then
megatron_options="${megatron_options} \\
        --create-moe-param-group"
fi
if [ "${MOE_DROP_TOKEN}" = "false" ]; then
megatron_options="${megatron_options} \\
        --disable-moe-token-dropping"
fi
template_json="ds_config_gpt_TEMPLATE.json"
config_json="ds_config_gpt_${NAME}.json"
sed "s/CONFIG_BATCH_SIZE/${GLOBAL_BATCH_SIZE}/" ${template_json} \\
    | sed "s/CONFIG_MBSIZE/${BATCH_SIZE}/" \\
    | sed "s/ZERO_STAGE/0/" \\
    | sed "s/CONFIG_FP16_ENABLED/true/" \\
    | sed "s/CONFIG_CL_ENABLED/${CL_ENABLED}/" \\
    | sed "s/CONFIG_CL_DURATION/${CL_STEP}/" \\
	  > ${config_json}
deepspeed_options=" \\
		    --deepspeed \\
		    --deepspeed_config ${config_json} \\
		    --pipeline-model-parallel-size 1"
if [[ $EP_SIZE -gt 1 ]]; then
deepspeed_options="${deepspeed_options} \\
        --no-pipeline-parallel"
fi
for (( node = 0; node <= NUM_NODE-1; node++ ))
do
    if $(ssh -q worker-"$node" "test -f \\"$ITERATION_FILE\\""); then
        LOCAL_ITERATION=$(ssh -q worker-"$node" cat $ITERATION_FILE)
    fi
done
run_cmd="deepspeed ${DIR}/../../pretrain_gpt.py ${megatron_options} ${data_options} ${deepspeed_options} &> log"
eval ${run_cmd}
"""
DS_MOE_TEMPLATE = """{
  "train_batch_size" : CONFIG_BATCH_SIZE,
  "train_micro_batch_size_per_gpu": CONFIG_MBSIZE,
  "zero_optimization": {"stage": ZERO_STAGE},
  "fp16": {"enabled": CONFIG_FP16_ENABLED, "loss_scale": 0, "initial_scale_power": 11},
  "curriculum_learning": {"enabled": CONFIG_CL_ENABLED, "schedule_config": {"total_curriculum_step": CONFIG_CL_DURATION}}
}
"""
DS_PARSER = "add('--moe-expert-parallel-size'); add('--num-experts'); add('--train-iters')"


def ds_moe_tree(root: Path, layout: str = "examples_deepspeed") -> str:
    return make_tree(root, parser=DS_PARSER, scripts={f"{layout}/MoE/ds_pretrain_gpt_125M_MoE64.sh": DS_MOE,
                                                      f"{layout}/MoE/ds_config_gpt_TEMPLATE.json": DS_MOE_TEMPLATE})


@pytest.mark.parametrize("layout", ["examples_deepspeed", "examples"])
def test_the_forks_moe_is_present_with_its_parser_flags_and_its_script(tmp_path, layout):
    tree = ds_moe_tree(tmp_path / "fork", layout)
    assert "ds-moe" in [f.name for f in registry.families_for(tree)]
    # upstream's MoE parser (--num-experts, no --moe-expert-parallel-size) and no script: absent
    upstream = make_tree(tmp_path / "upstream", parser=PARSER)
    assert "ds-moe" not in [f.name for f in registry.families_for(upstream)]
    # the fork's parser without the script (or the script without the parser): absent
    no_script = make_tree(tmp_path / "no-script", parser=DS_PARSER)
    no_parser = make_tree(tmp_path / "no-parser", parser="add('--num-experts')",
                          scripts={"examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh": DS_MOE})
    assert "ds-moe" not in [f.name for f in registry.families_for(no_script)]
    assert "ds-moe" not in [f.name for f in registry.families_for(no_parser)]


def test_the_forks_moe_flags_are_its_shell_strings_with_their_if_blocks_decided(tmp_path):
    tokens, source = registry.get("ds-moe").flags(ds_moe_tree(tmp_path))
    assert source == "examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh of the tree"
    value = lambda flag: example.flag_value(tokens, flag)  # noqa: E731
    assert (value("--num-experts"), value("--num-layers"), value("--lr"), value("--micro-batch-size"),
            value("--lr-warmup-tokens"), value("--train-tokens")) == ("64", "12", "4.5e-4", "4", "375000000",
                                                                     "300000000000")
    # NUM_GPUS is shell arithmetic: the test on it is not decided, both branches stay, the last wins
    assert value("--moe-expert-parallel-size") == "64"
    # decided: ACTIVATION_CHECKPOINT="true", EP_SIZE 64 > 1, MOE_DROP_TOKEN="true" (not "false")
    assert {"--checkpoint-activations", "--create-moe-param-group", "--deepspeed", "--no-pipeline-parallel"} <= set(tokens)
    assert "--disable-moe-token-dropping" not in tokens
    # values that are shell arithmetic or paths are not read
    assert "--train-iters" not in tokens and "--deepspeed_config" not in tokens and "--load" not in tokens


def test_the_forks_moe_runs_shrunk_with_the_scripts_deepspeed_config(tmp_path):
    import json

    tree = ds_moe_tree(tmp_path / "tree")
    work = tmp_path / "work"
    work.mkdir()
    sizes = example.Sizes(layers=2, hidden=64, heads=4, seq=64, batch=2, steps=100)
    cmd = pretrain.command(pretrain.Run(tree=tree, sizes=sizes, family="ds-moe", initial_loss_scale=4096.0), str(work))
    flags = cmd.argv[cmd.argv.index("pretrain_gpt.py") + 1:]
    value = lambda flag: example.flag_value(flags, flag)  # noqa: E731
    assert (value("--num-experts"), value("--moe-expert-parallel-size"), value("--num-layers"),
            value("--hidden-size"), value("--micro-batch-size"), value("--train-iters")) == ("4", "1", "2", "64", "2",
                                                                                          "100")
    # the token schedule over the run's 100 x 2 x 64 tokens, warmup the script's share of it
    assert (value("--lr-decay-tokens"), value("--train-tokens"), value("--lr-warmup-tokens")) == ("12800", "12800", "16")
    assert "--deepspeed" in flags and "--load" not in flags
    config = json.loads(Path(value("--deepspeed_config")).read_text())
    assert config["train_batch_size"] == 2 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["zero_optimization"] == {"stage": 0}  # the script's stage, kept
    # the run's initial loss scale (2**12) where DeepSpeed reads it; the disabled legacy curriculum
    # key today's DeepSpeed refuses, left out
    assert config["fp16"]["initial_scale_power"] == 12 and "curriculum_learning" not in config
    assert any("curriculum_learning left out" in n and "initial_scale_power 12" in n for n in cmd.notes)
    assert any(n.startswith("--train-iters added") for n in cmd.notes)


def test_the_forks_moe_refuses_a_config_that_keeps_a_value_it_cannot_compute(tmp_path):
    tree = make_tree(tmp_path / "tree", parser=DS_PARSER, scripts={
        "examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh": DS_MOE.replace('CL_ENABLED="false"', 'CL_ENABLED="true"'),
        "examples_deepspeed/MoE/ds_config_gpt_TEMPLATE.json": DS_MOE_TEMPLATE})
    with pytest.raises(ValueError, match="shell arithmetic"):
        registry.get("ds-moe").deepspeed_config(tree, str(tmp_path), pretrain.Run(tree=tree), [])


def test_the_forks_moe_reader_decides_literal_tests_and_keeps_undecided_branches():
    from megaport.train.families.ds_moe import decided

    text = "\n".join(['A=1', 'B="x"',
                      'if [ "$B" = "y" ]; then', ' one', 'elif [[ $A -eq 1 ]]; then', ' two', 'else', ' three', 'fi',
                      'if [[ $A -gt 0 ]]; then', ' four', 'elif [ "$Z" = "q" ]; then', ' five', 'else', ' six', 'fi',
                      'if [ "$Z" = "q" ]; then', ' seven', 'else', ' eight', 'fi'])
    assert decided(text).split() == ["A=1", "B=x", "two", "four", "seven", "eight"]


def test_t5_gives_the_sentinels_its_script_left_out_before_upstreams_3dadd16d(tmp_path):
    """examples/pretrain_t5.sh before 3dadd16d (2021-06-07; Megatron-DeepSpeed's 2021-2022 trees)
    lacks the --vocab-extra-ids that pretrain_t5.py asserts: added, and said; never twice."""
    from megaport.train.pretrain import _family_flags

    t5 = registry.get("t5")
    parser = "add('--num-layers'); add('--vocab-extra-ids')"
    tree = make_tree(tmp_path / "tree", entry_points=("pretrain_t5.py",), parser=parser)
    notes: list = []
    flags = _family_flags(t5, ["--num-layers", "12", "--fp16"], tree, notes)
    assert example.flag_value(flags, "--vocab-extra-ids") == "100"
    assert any(n.startswith("--vocab-extra-ids added") and "3dadd16d" in n for n in notes)
    notes = []
    flags = _family_flags(t5, ["--num-layers", "12", "--vocab-extra-ids", "100"], tree, notes)
    assert flags.count("--vocab-extra-ids") == 1 and not any("--vocab-extra-ids" in n for n in notes)


def test_a_value_the_eras_parser_has_no_choice_for_is_left_out_and_said(tmp_path):
    """DeepSeek-V2-Lite's flags (2025) on core 0.9: seq_aux_loss is not among that parser's choices."""
    tree = make_tree(tmp_path / "tree", parser=PARSER + "add('--multi-latent-attention'); add('--num-experts'); "
                     "add('--lr'); add('--moe-router-load-balancing-type', type=str, choices=['aux_loss', 'sinkhorn', 'none'])")
    assert example.parser_choices(tree, "--moe-router-load-balancing-type") == ("aux_loss", "sinkhorn", "none")
    assert example.parser_choices(tree, "--num-experts") is None
    cmd = pretrain.command(pretrain.Run(tree=tree, sizes=example.Sizes(steps=3), family="deepseek"), str(tmp_path))
    assert "--moe-router-load-balancing-type" not in cmd.argv
    assert any(n.startswith("--moe-router-load-balancing-type seq_aux_loss left out") for n in cmd.notes)
    assert cmd.argv[cmd.argv.index("--lr") + 1] == "4.2e-4"  # the conf file has none; parsers before 2025 need one


def test_deepseek_takes_one_head_where_the_trees_mla_cannot_build_more(tmp_path):
    from megaport.train.families import deepseek

    tree = make_tree(tmp_path / "tree")
    mla = Path(tree) / "megatron/core/transformer/multi_latent_attention.py"
    mla.parent.mkdir(parents=True)
    mla.write_text("key = torch.cat([k_no_pe, k_pos_emb], dim=-1)\n")  # core 0.9 … 2024-12-07
    sizes = example.Sizes()
    assert deepseek.FAMILY.size_flags(sizes, tree)["--num-attention-heads"] == [1]
    mla.write_text("k_pos_emb = k_pos_emb.expand(-1, -1, self.config.num_attention_heads, -1)\n")
    assert deepseek.FAMILY.size_flags(sizes, tree)["--num-attention-heads"] == [sizes.heads]


def test_a_family_whose_layers_need_a_missing_package_skips_with_one_line():
    """verify's training tests of such a family skip, saying which upstream dependency is missing
    (``--strict`` counts the skip); with the package there, nothing is skipped."""
    from megaport.smoke.test_training import _skip_without_what_the_model_needs

    facts: dict = {}
    missing = Family(name="moe-x", entry_point="pretrain_gpt.py", summary="", needs=("megaport_no_such_package",))
    with pytest.raises(pytest.skip.Exception) as skipped:
        _skip_without_what_the_model_needs(missing, facts)
    line = str(skipped.value)
    assert line == facts["error"] and "\n" not in line
    assert line.startswith("needs megaport_no_such_package, an upstream dependency not installed here")
    _skip_without_what_the_model_needs(Family(name="moe-y", entry_point="pretrain_gpt.py", summary="",
                                              needs=("json",)), {})


def test_loss_parity_on_a_gpu_trains_the_sizes_it_trains_on_the_cpu(tmp_path):
    """The first GPU verify (H100, main 2026-08) compared at pretrain's kernel-timing sizes (hidden 256,
    seq 512): Llama memorised the mock data by iteration 25 and the two trees' rounding parted
    chaotically (515 % in loss; the same sizes on the CPU 286 %). Parity is the same experiment on
    every device: the family's own sizes (0.2 % on the CPU)."""
    from megaport.train import parity

    tree = make_tree(tmp_path / "tree", entry_points=("pretrain_gpt.py",), parser=PARSER)
    for family in ("gpt", "llama", "mixtral"):
        on_gpu, on_cpu = (parity.parity_run(tree, family=family, gpu=gpu) for gpu in (True, False))
        assert (on_gpu.device, on_cpu.device) == ("cuda", "cpu")
        assert on_gpu.sizes == on_cpu.sizes and on_gpu.lr == on_cpu.lr, family


@pytest.mark.parametrize("pretrain_bert, expected", [
    ("elif args.spec[0] == 'local':\n", [("--spec", "local")]),
    ("transformer_layer_spec = import_module(args.spec)\n",
     [("--spec", "megatron.core.models.bert.bert_layer_specs", "bert_layer_local_spec")]),
    ("model = BertModel(num_tokentypes=2)\n", []),
])
def test_berts_local_spec_is_named_as_the_eras_spec_flag_takes_it(tmp_path, pretrain_bert, expected):
    """2023-11 … 2024-02 --spec took a module and a function (``--spec local`` failed the parser:
    "expected 2 arguments", core-0.4-0.5's oldest commit); from 2024-02 pretrain_bert.py reads 'local'."""
    (tmp_path / "pretrain_bert.py").write_text(pretrain_bert)
    specs = tmp_path / "megatron/core/models/bert/bert_layer_specs.py"
    specs.parent.mkdir(parents=True)
    specs.write_text("bert_layer_local_spec = ModuleSpec()\n")
    (tmp_path / "megatron/arguments.py").write_text("group.add_argument('--spec', type=str, nargs='*')\n")
    assert [added for added, _ in registry.FAMILIES["bert"].fusions_off_for(str(tmp_path))] == expected
