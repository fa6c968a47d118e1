"""``cpu-init-rank-name``: mpu's CPU weight initialization finds its rank, as upstream's 7db9c1e55c made it.

From v2.0 (be473a5bd2, 2021-01-12) until 7db9c1e55c (2021-01-25) ``_initialize_affine_weight_cpu``
in ``megatron/mpu/layers.py`` called ``get_model_parallel_rank``, which mpu had renamed
``get_tensor_model_parallel_rank``: with ``--use-cpu-initialization`` every parallel linear layer
failed to build (``NameError``). Here the module is handed the name, bound to the renamed function,
which is the call upstream's fix makes. The port fixes the same window in its own way
(``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "cpu-init-rank-name"
DESCRIPTION = ("v2.0 … main 2021-01-25: mpu's CPU weight initialization called the renamed get_model_parallel_rank "
               "(NameError with --use-cpu-initialization); the rank asked of get_tensor_model_parallel_rank, as "
               "upstream's 7db9c1e55c")
ERAS = "v2.0 (be473a5bd2, 2021-01-12) … main 2021-01-25 (7db9c1e55c), with --use-cpu-initialization"
REPRODUCES = "upstream's 7db9c1e55c (ckpt_merge)"
PATTERN = (Match(("NameError",), message=r"'get_model_parallel_rank' is not defined", file=r"mpu[/\\]layers\.py"),)


def rank_named(module) -> None:
    if not hasattr(module, "get_model_parallel_rank") and hasattr(module, "get_tensor_model_parallel_rank"):
        module.get_model_parallel_rank = module.get_tensor_model_parallel_rank


def install() -> None:
    after_import("megatron.mpu.layers", rank_named)
