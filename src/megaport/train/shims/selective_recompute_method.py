"""``selective-recompute-method``: core's TransformerConfig takes selective recomputation without a method, as upstream's 8b9a2510f5.

From 3316e811cc (main 2023-06-29) until 8b9a2510f5 (main 2023-07-06; Megatron-DeepSpeed until
d9fa3022, 2023-09-18) ``TransformerConfig.__post_init__`` asked ``--recompute-granularity selective`` for a
recompute method, which the parser refuses beside it: selective recomputation never started. Here
its recomputation checks are skipped for selective recomputation without a method (they only check
what full recomputation needs); the port fixes the same window in its own way
(``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "selective-recompute-method"
DESCRIPTION = ("main 2023-06-29 … 07-06 (Megatron-DeepSpeed until 2023-09-18): selective recomputation without a "
               "recompute method, as upstream's 8b9a2510f5 (the config asked for one, the parser refused it)")
ERAS = "main 3316e811cc (2023-06-29) … 83fda184db (2023-07-06); Megatron-DeepSpeed 9e72d571 … d9fa3022 (2023-09-18)"
REPRODUCES = "upstream's 8b9a2510f5 (Fix wrong config check)"
PATTERN = (Match(("ValueError",), message=r"recompute_granularity: selective so recompute_method must be",
                 file=r"transformer_config\.py"),)


def selective_without_method(module) -> None:
    check = module.TransformerConfig.__post_init__

    def __post_init__(self, *args, **kwargs):
        if self.recompute_granularity == "selective" and self.recompute_method is None:
            self.recompute_granularity = None
            try:
                return check(self, *args, **kwargs)
            finally:
                self.recompute_granularity = "selective"
        return check(self, *args, **kwargs)

    module.TransformerConfig.__post_init__ = __post_init__


def install() -> None:
    after_import("megatron.core.transformer.transformer_config", selective_without_method)
