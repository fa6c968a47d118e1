"""DeepSeek-V2-Lite: multi-latent attention and fine-grained MoE (64 experts, top-6, a shared
expert, the first layer dense), through ``pretrain_gpt.py``; flags from upstream's
``examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh``.

That file holds the model's flags only (ModelOpt's scripts add the rest): the run adds
``--train-iters`` and a learning rate; the schedule is upstream's default (constant).
"""

from megaport.train import example
from megaport.train.families.spec import Family, entry_point_and

SCRIPT = "examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh"


def _sizes(sizes: example.Sizes, tree: str) -> dict:
    head = sizes.hidden // sizes.heads
    return {"--ffn-hidden-size": [4 * sizes.hidden], "--kv-channels": [head], "--kv-lora-rank": [2 * head],
            "--qk-head-dim": [head], "--v-head-dim": [head], "--qk-pos-emb-head-dim": [head // 2],
            "--num-experts": [8], "--moe-ffn-hidden-size": [sizes.hidden],
            "--moe-shared-expert-intermediate-size": [2 * sizes.hidden],
            "--moe-layer-freq": [f"[0]+[1]*{sizes.layers - 1}"], "--make-vocab-size-divisible-by": [128]}


FAMILY = Family(
    name="deepseek",
    entry_point="pretrain_gpt.py",
    summary="DeepSeek-V2-Lite: multi-latent attention, 64-expert MoE with a shared expert",
    scripts=(SCRIPT,),
    present=entry_point_and("--multi-latent-attention", "--num-experts"),
    size_flags=_sizes,
    added=((("--train-iters", "1", "--global-batch-size", "1", "--clip-grad", "1.0"),
            "the conf file has the model's flags only: the run's iterations, one batch a step, upstream's "
            "default clipping"),),
)
