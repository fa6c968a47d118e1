"""Mixtral 8x7B: upstream's ``examples/mixtral/train_mixtral_8x7b_distributed.sh`` (from 2024-07),
through ``pretrain_gpt.py``: MoE (top-2 of 8 experts, grouped GEMM, all-to-all dispatcher),
RMSNorm, RoPE, SwiGLU, GQA.
"""

from megaport.train import example
from megaport.train.tree_files import tree_says
from megaport.train.families.spec import Family, entry_point_and, query_groups

SCRIPT = "examples/mixtral/train_mixtral_8x7b_distributed.sh"


def _sizes(sizes: example.Sizes, tree: str) -> dict:
    return {"--ffn-hidden-size": [4 * sizes.hidden], "--num-query-groups": [query_groups(sizes, tree)],
            "--num-experts": [4], "--expert-model-parallel-size": [1],
            "--lr-warmup-iters": [max(1, sizes.steps // 10)]}


#: what the era says where grouped-GEMM experts take bf16 alone: its argument checks (core 0.5 …
#: 0.8), then, once upstream dropped that check (4193f3aa9b, 2025-12-22), GroupedMLP's forward, which
#: a tree without TE builds, until upstream removed GroupedMLP (2caa681a1d, 2026-03-04): core 0.16.1's
#: fp32 EP2 failed there. ((files, text), ...)
_GROUPED_GEMM_BF16_ONLY = ((example.ARGUMENT_FILES, "GroupedGEMM for MoE only supports bf16"),
                           (("megatron/core/transformer/moe/experts.py",), "GroupedMLP for MoE only supports bf16"))


def _compared_in_fp32(tree: str) -> tuple:
    """bf16 rounds a TP or EP split's partial sums otherwise than one rank's, and top-2 routing
    turns that into another expert: core 0.8's ep2-tp2 left one rank by 6.7 % in grad norm at one
    step, the loss within 7.2e-4. In fp32 a split rounds 1e-7 apart and routes alike: the layouts
    are compared in fp32 (bf16 training is the family's one-rank parity), with the sequential
    experts where the era's grouped GEMM takes bf16 alone."""
    left_out = (("--bf16", "layouts are compared in fp32: bf16's rounding of a split's partial sums turns top-2 "
                           "routing to other experts"),)
    if any(tree_says(tree, path, text) for paths, text in _GROUPED_GEMM_BF16_ONLY for path in paths):
        left_out += (("--moe-grouped-gemm", "this era's grouped GEMM takes bf16 alone: the fp32 layout comparison "
                                            "builds the sequential experts (the same experts, one GEMM each)"),)
    return left_out


FAMILY = Family(
    name="mixtral",
    entry_point="pretrain_gpt.py",
    summary="Mixtral 8x7B MoE (top-2 routing, grouped GEMM, all-to-all), RMSNorm, RoPE, SwiGLU, GQA",
    scripts=(SCRIPT,),
    # the script as of 2024-07 (its model, MoE and training flags), for trees with MoE but no script
    fallback=tuple(("--disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32 "
                    "--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01 "
                    "--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type "
                    "rope --swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 "
                    "--no-masked-softmax-fusion --no-position-embedding --num-experts 8 --moe-router-topk 2 "
                    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm "
                    "--moe-token-dispatcher-type alltoall --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 "
                    "--train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 "
                    "--weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 --tensor-model-parallel-size 1 "
                    "--pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --use-distributed-optimizer "
                    "--sequence-parallel").split()),
    fallback_source=f"{SCRIPT} as of 2024-07 (the tree has MoE but no Mixtral script)",
    present=entry_point_and("--num-experts", "--normalization", "--moe-router-topk"),
    size_flags=_sizes,
    # top-2 routing turns rounding into another expert, more often the larger the step: at GPT's
    # 3e-3 ported and unported drifted 13 % apart in grad norm late in the run (core 0.9; 6.2 % on
    # core 0.17) with the loss within 1 %; at 1e-3 6.3e-4 in loss, 1.3e-2 in grad norm, loss -25 %
    parity_learning_rate=1e-3,
    # at 1e-3 its loss fell 6.4 % in 30 iterations on core 0.6-0.7's indexed data (EP2 and one rank
    # 1.3e-4 apart): the layouts are compared over 50
    layout_steps=50,
    layout_left_out=_compared_in_fp32,
    # main 2024-01 … 05: upstream's chained expert and dense optimizers clipped by their own norms
    # (the port fixes it as upstream's ddfcc589c0 did; unported upstream gets the same, written apart)
    baseline_shims=("chained-clip-total-norm",),
)
