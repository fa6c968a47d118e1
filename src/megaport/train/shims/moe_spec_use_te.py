"""``moe-spec-use-te``: the local GPT spec's MoE layer is built of local layers, as upstream's 37cd8f280d does.

On main from 60d5b383fa (2024-12-07) until 37cd8f280d (2024-12-09) ``_get_mlp_module_spec`` called
``_get_moe_module_spec(use_te=True, ...)`` whatever ``use_te`` it was given, so without
TransformerEngine every MoE model (Mixtral, DeepSeek) failed to build: ``NameError: name
'TEColumnParallelGroupedLinear' is not defined`` (``TEColumnParallelLinear`` for the shared
experts). Here the function's source line is replaced by the one 37cd8f280d passes and the function
compiled again in its module. The port fixes the same window in its own way
(``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

import inspect

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match
from megaport.train.tree_files import tree_says

NAME = "moe-spec-use-te"
DESCRIPTION = ("main 2024-12-07 (60d5b383fa) … 2024-12-09 (37cd8f280d): the local GPT spec asked its MoE layer "
               "for TransformerEngine's layers whatever use_te said, a NameError without TE; use_te passed on, "
               "as upstream's 37cd8f280d")
ERAS = "main 2024-12-07 (60d5b383fa) … 2024-12-09 (37cd8f280d)"
REPRODUCES = "upstream's 37cd8f280d (hongxiaob/moe_spec)"
SPEC_FILE = "megatron/core/models/gpt/gpt_layer_specs.py"
# the call inside _get_mlp_module_spec (the TE spec's own call of it passes use_te=True rightly)
BROKEN = "moe_spec = _get_moe_module_spec(\n            use_te=True,"
FIXED = "moe_spec = _get_moe_module_spec(\n            use_te=use_te,"
PATTERN = (Match(("NameError",), message=r"'TE(Column|Row)Parallel(Grouped)?Linear' is not defined",
                 file=r"gpt_layer_specs\.py"),)


def applies(tree: str) -> bool:
    """Whether the unported ``tree``'s GPT specs have the window's call."""
    return tree_says(tree, SPEC_FILE, BROKEN)


def moe_spec_takes_use_te(module) -> None:
    function = getattr(module, "_get_mlp_module_spec", None)
    source = inspect.getsource(function) if function is not None else ""
    if BROKEN not in source:
        return
    scope: dict = {}
    exec(compile(source.replace(BROKEN, FIXED), inspect.getsourcefile(function), "exec"), module.__dict__, scope)
    module._get_mlp_module_spec = scope["_get_mlp_module_spec"]


def install() -> None:
    after_import("megatron.core.models.gpt.gpt_layer_specs", moe_spec_takes_use_te)
