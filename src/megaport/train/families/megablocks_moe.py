"""Stanford-Megatron-LM's MoE: its GPT with MegaBlocks' MoE layers (top-1 routing with a capacity
factor, the load-balancing loss its ``pretrain_gpt.py`` adds), through that ``pretrain_gpt.py``.

The tree ships no MoE script: MegaBlocks' own ``exp/moe/moe_46m_8gpu.sh`` (databricks/megablocks
2726ca7e) is what runs it, and its flags are written here (its data, checkpoint, evaluation and
launcher flags left to the run). For any ``--moe-num-experts`` run the tree's ``pretrain_gpt.py``
takes the loss from ``megablocks.layers.moe``, even with ``--moe-use-megatron-switch``: without
MegaBlocks the family cannot train, and MegaBlocks builds only against a GPU (its ``setup.py``
reads the CUDA device's capability; ROCm/megablocks on a ROCm box). Where it is not installed the
family's tests say so in one line (a skip, which ``--strict`` counts).
"""

from megaport.train.families.spec import Family, entry_point_and
from megaport.train.tree_files import tree_text

#: MegaBlocks' exp/moe/moe_46m_8gpu.sh, its defaults for the script's positional arguments
#: (TRAINING_STEPS 20000, NUM_EXPERTS 64, CAPACITY_FACTOR 16384, TOP_K 1, LOSS_WEIGHT 0.1, BATCH_SIZE 64)
MOE = "--moe-num-experts 64 --moe-capacity-factor 16384 --moe-loss-weight 0.1 --moe-top-k 1".split()
MODEL = "--num-layers 6 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024".split()
TRAINING = ("--micro-batch-size 64 --global-batch-size 512 --train-iters 20000 --lr-decay-iters 20000 --lr 0.00015 "
            "--min-lr 0.00001 --lr-decay-style cosine --lr-warmup-fraction 0.01 --clip-grad 1.0 "
            "--init-method-std 0.01").split()
COMPUTE = "--fp16 --DDP-impl local --moe-expert-model-parallelism --no-async-tensor-model-parallel-allreduce".split()
#: the experts a shrunk run has (the script's 64 over an 8-rank expert-parallel group)
EXPERTS = 4
_ADAPTER = "megatron/model/megablocks_utils.py"


def _present(tree: str) -> bool:
    return tree_text(tree, _ADAPTER) is not None and entry_point_and("--moe-num-experts")(tree)


_present.__doc__ = f"pretrain_gpt.py, the parser's --moe-num-experts and {_ADAPTER}"

FAMILY = Family(
    name="megablocks-moe",
    entry_point="pretrain_gpt.py",
    summary="Stanford-Megatron-LM's GPT with MegaBlocks MoE layers (top-1, capacity factor, load-balancing loss)",
    fallback=tuple(MOE + MODEL + TRAINING + COMPUTE),
    fallback_source="MegaBlocks' exp/moe/moe_46m_8gpu.sh (databricks/megablocks 2726ca7e), as "
                    "megaport.train.families.megablocks_moe writes it",
    present=_present,
    size_flags=lambda sizes, tree: {"--moe-num-experts": [EXPERTS]},
    needs=("megablocks",),
)
