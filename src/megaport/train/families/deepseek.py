"""DeepSeek-V2-Lite: multi-latent attention and fine-grained MoE (64 experts, top-6, a shared
expert, the first layer dense), through ``pretrain_gpt.py``; flags from upstream's
``examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh``.

That file holds the model's flags only (ModelOpt's scripts add the rest): the run adds
``--train-iters`` and a learning rate; the schedule is upstream's default (constant). Trees with
multi-latent attention from before the file (core 0.9 … 2025-02) take its flags as megaport
writes them (the file has not changed since it was added, bf687df047).
"""


from megaport.train import example
from megaport.train.families.spec import Family, entry_point_and
from megaport.train.tree_files import tree_text

SCRIPT = "examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh"
#: the file's MODEL_ARGS (bf687df047, 2025-02-28, unchanged to 2026-08)
MODEL_ARGS = tuple("""
    --save-interval 100000 --attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 1 --bf16
    --no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --num-layers 27 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 --kv-channels 16
    --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --qk-head-dim 128 --qk-layernorm
    --qk-pos-emb-head-dim 64 --num-experts 64 --moe-layer-freq ([0]+[1]*26) --moe-ffn-hidden-size 1408
    --moe-grouped-gemm --moe-router-score-function softmax --moe-router-topk 6 --moe-router-topk-scaling-factor 1.0
    --moe-router-pre-softmax --moe-shared-expert-intermediate-size 2816 --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --moe-router-load-balancing-type seq_aux_loss
    --seq-length 1024 --max-position-embeddings 1024 --tokenizer-type HuggingFaceTokenizer
    --make-vocab-size-divisible-by 3200 --attention-softmax-in-fp32 --use-mcore-models --rotary-percent 1.0
    --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --sequence-parallel
    """.split())


#: MLA's key joins the heads' own part with the one RoPE part all heads share; until 47ab878ae7
#: (2024-12-07) upstream concatenated them without expanding the shared part to the heads, which
#: torch.cat refuses for more than one head ("Sizes of tensors must match"), on any device
_MLA = "megatron/core/transformer/multi_latent_attention.py"
_MLA_SHARED_ROPE_EXPANDED = "k_pos_emb = k_pos_emb.expand("


def attention_heads(sizes: example.Sizes, tree: str) -> int:
    """The shrunk run's heads: one where the tree's MLA cannot build more (:data:`_MLA`'s bug)."""
    text = tree_text(tree, _MLA)
    return 1 if text is not None and _MLA_SHARED_ROPE_EXPANDED not in text else sizes.heads


#: from dcf9e77608 (2024-09-24, MLA's arrival) until ea94163be7 (2025-02-02, "MLA_TP") MLA asserted
#: a tensor-parallel size of 1 when built
_MLA_REFUSES_TP = "MLA is not supported with Tensor Parallelism yet"


def _tensor_parallel_refused(tree: str, layout) -> str | None:
    """Why a TP layout cannot split the era's MLA, or None: it builds one head
    (:func:`attention_heads`), or it refuses TP outright (:data:`_MLA_REFUSES_TP`)."""
    if layout.tensor_parallel <= 1:
        return None
    if attention_heads(FAMILY.sizes, tree) < layout.tensor_parallel:
        return ("this era's multi-latent attention builds one head only (upstream concatenated the shared RoPE key "
                "part without expanding it to the heads until 47ab878ae7, 2024-12-07), which tensor parallelism "
                "cannot split")
    if _MLA_REFUSES_TP in (tree_text(tree, _MLA) or ""):
        return ("this era's multi-latent attention refuses tensor parallelism (upstream asserted a TP size of 1 "
                "until ea94163be7, 2025-02-02: \"MLA is not supported with Tensor Parallelism yet\")")
    return None


def _sizes(sizes: example.Sizes, tree: str) -> dict:
    heads = attention_heads(sizes, tree)
    head = sizes.hidden // heads
    return {"--num-attention-heads": [heads],
            "--ffn-hidden-size": [4 * sizes.hidden], "--kv-channels": [head], "--kv-lora-rank": [2 * head],
            "--qk-head-dim": [head], "--v-head-dim": [head], "--qk-pos-emb-head-dim": [head // 2],
            "--num-experts": [8], "--moe-ffn-hidden-size": [sizes.hidden],
            "--moe-shared-expert-intermediate-size": [2 * sizes.hidden],
            "--moe-layer-freq": [f"[0]+[1]*{sizes.layers - 1}"], "--make-vocab-size-divisible-by": [128]}


FAMILY = Family(
    name="deepseek",
    entry_point="pretrain_gpt.py",
    summary="DeepSeek-V2-Lite: multi-latent attention, 64-expert MoE with a shared expert",
    scripts=(SCRIPT,),
    fallback=MODEL_ARGS,
    fallback_source=f"{SCRIPT} as of bf687df047 (the tree predates it), as megaport.train.families.deepseek writes it",
    present=entry_point_and("--multi-latent-attention", "--num-experts"),
    size_flags=_sizes,
    added=((("--train-iters", "1", "--global-batch-size", "1", "--clip-grad", "1.0"),
            "the conf file has the model's flags only: the run's iterations, one batch a step, upstream's "
            "default clipping"),
           (("--lr", "4.2e-4"), "the conf file sets no learning rate, which parsers before 2025 require: "
                                "DeepSeek-V2-Lite's peak rate (DeepSeek-V2 paper, appendix B)")),
    # top-6 routing turns rounding into other experts, as Mixtral's top-2 does: at GPT's 3e-3 core
    # 0.9 (every layer MoE: its parser has no --moe-layer-freq) drifted 2.4 % apart in loss and 67 %
    # in grad norm from step 5; at 1e-3 4.1e-4 / 2.2e-2, loss -27 %
    parity_learning_rate=1e-3,
    # at 1e-3 its loss fell 6.4 % in 30 iterations on core 0.12's indexed data (TP2 + SP and one
    # rank 1.4e-4 apart): the layouts are compared over 50, as Mixtral's
    layout_steps=50,
    layout_refused=_tensor_parallel_refused,
)
