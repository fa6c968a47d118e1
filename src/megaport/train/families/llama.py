"""Llama-2 style: upstream's ``pretrain_gpt.py`` with RMSNorm, SwiGLU, RoPE, grouped-query
attention, no biases and untied embeddings, where the era's parser has them.

Upstream ships no Llama-2 training script; the architecture flags are those upstream's
``docs/llama_mistral.md`` gives for its Llama-2/3 checkpoints (``--normalization RMSNorm --swiglu
--position-embedding-type rope --no-position-embedding --disable-bias-linear
--untie-embeddings-and-output-weights --group-query-attention``, ROCm's Megatron-LM guide trains
Llama-2 with the same), the attention backend that of ``examples/llama`` (``--attention-backend
fused``, left out where the era's parser has no such flag), the training flags those of the gpt3
example. No ``--apply-layernorm-1p``
(Llama 3's zero-centred gamma, the ``llama3`` family) and no FP8: both need TransformerEngine.
"""

from megaport.train import example
from megaport.train.families.spec import Family, entry_point_and, query_groups

ARCHITECTURE = ("--normalization RMSNorm --swiglu --position-embedding-type rope --no-position-embedding "
                "--disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention "
                "--num-query-groups 8 --attention-dropout 0.0 --hidden-dropout 0.0 --rotary-percent 1.0 "
                "--init-method-std 0.02 --norm-epsilon 1e-5 --attention-backend fused").split()
# Llama-2 7B's sizes (Touvron et al. 2023, table 1), shrunk by the run like every family's
SIZES = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --seq-length 4096 "
         "--max-position-embeddings 4096").split()
# the gpt3 example's training flags (examples/gpt3/train_gpt3_175b_distributed.sh)
TRAINING = ("--micro-batch-size 1 --global-batch-size 1536 --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 "
            "--adam-beta2 0.95 --clip-grad 1.0 --bf16 --lr 3.0e-4 --lr-decay-style cosine --min-lr 3.0e-5 "
            "--lr-warmup-fraction .001 --lr-decay-iters 430000 --tensor-model-parallel-size 1 "
            "--pipeline-model-parallel-size 1").split()


def _sizes(sizes: example.Sizes, tree: str) -> dict:
    return {"--ffn-hidden-size": [4 * sizes.hidden], "--num-query-groups": [query_groups(sizes, tree)],
            "--kv-channels": [sizes.hidden // sizes.heads]}


FAMILY = Family(
    name="llama",
    entry_point="pretrain_gpt.py",
    summary="Llama-2 style decoder (RMSNorm, SwiGLU, RoPE, GQA, no bias, untied embeddings)",
    fallback=tuple(SIZES + ARCHITECTURE + TRAINING),
    fallback_source="upstream's docs/llama_mistral.md (Llama-2 architecture) and the gpt3 example (training), as "
                    "megaport.train.families.llama writes them",
    present=entry_point_and("--normalization", "--swiglu", "--group-query-attention", "--disable-bias-linear",
                            "--untie-embeddings-and-output-weights", "--no-position-embedding"),
    size_flags=_sizes,
)
