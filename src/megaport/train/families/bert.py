"""BERT: upstream's ``pretrain_bert.py`` (v2.0 to main of 2026-05), with the padding-mask softmax.

BERT and T5 are the only upstream trainings that run the *padding-mask* fused softmax
(``scaled_masked_softmax``); GPT runs the causal one. Flags: ``examples/bert/train_bert_340m_distributed.sh``
(2024 on) or ``examples/pretrain_bert.sh`` (before).
"""

from megaport.train import example
from megaport.train.families.spec import Family, entry_point_and
from megaport.train.tree_files import tree_says

_BERT_MODEL = "megatron/core/models/bert/bert_model.py"


def _bert_model_asks_for_nvte(tree: str) -> bool:
    """Whether the tree's megatron.core BertModel reads NVTE_FLASH_ATTN (core 0.6 to 0.9)."""
    return tree_says(tree, _BERT_MODEL, "NVTE_FLASH_ATTN")


def _reads_local(tree: str) -> bool:
    """Whether pretrain_bert.py takes ``--spec local`` for its local layer spec (2024-02 on)."""
    return tree_says(tree, "pretrain_bert.py", "args.spec[0] == 'local'")


def _reads_a_pair(tree: str) -> bool:
    """Whether pretrain_bert.py imports ``--spec``'s module and function (2023-11 … 2024-02) and the
    tree has the local spec to name."""
    return (not _reads_local(tree) and tree_says(tree, "pretrain_bert.py", "import_module(args.spec)")
            and tree_says(tree, "megatron/core/models/bert/bert_layer_specs.py", "bert_layer_local_spec ="))


FAMILY = Family(
    name="bert",
    entry_point="pretrain_bert.py",
    summary="BERT-Large style encoder, masked LM and sentence-order head",
    scripts=("examples/bert/train_bert_340m_distributed.sh", "examples/pretrain_bert.sh"),
    # examples/pretrain_bert.sh of v2.0-2023 (its model and training flags)
    fallback=tuple("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --micro-batch-size 4 "
                   "--global-batch-size 8 --seq-length 512 --max-position-embeddings 512 --train-iters 2000000 "
                   "--lr-decay-iters 990000 --lr 0.0001 --min-lr 0.00001 --lr-decay-style linear "
                   "--lr-warmup-fraction .01 --weight-decay 1e-2 --clip-grad 1.0 --fp16".split()),
    fallback_source="examples/pretrain_bert.sh as of v2.0-2023 (the tree has no BERT example script)",
    present=entry_point_and(entry_point="pretrain_bert.py"),
    sizes=example.Sizes(),
    data="wordpiece",
    # pretrain_bert.py takes its layer spec from --spec, not --transformer-impl: without TE, unported
    # upstream refuses its default TE spec and says to use the local one; before 2024-02 --spec was a
    # module and function pair (the parser refused "--spec local"), which names the same local spec
    fusions_off=((("--spec", "local"), "pretrain_bert.py's local layer spec: unported upstream refuses its TE "
                                      "spec without TransformerEngine and says to use this", _reads_local),
                 (("--spec", "megatron.core.models.bert.bert_layer_specs", "bert_layer_local_spec"),
                  "pretrain_bert.py's local layer spec, named as this era's --spec takes it (a module and a "
                  "function): unported upstream has no TransformerEngine for its default TE spec", _reads_a_pair)),
    # megatron.core's BertModel (core 0.6 to 0.9) asserts one of these is 0 and says to set it; from
    # --attention-backend on (2024-11) the parser refuses it instead
    environment_needed=_bert_model_asks_for_nvte,
    environment={"NVTE_FLASH_ATTN": ("0", "megatron.core's BertModel (core 0.6 on; older BERTs ignore it) refuses to start "
                                          "without it: 'Bert currently "
                                          "does not support flash attention. Please set env variable "
                                          "NVTE_FLASH_ATTN=0'")},
    # Megatron-DeepSpeed's BERT takes Megatron's own loop, whose fp16 loss scaling its series fix
    baseline_shims=("fork-fp16-loss-scale",),
)
