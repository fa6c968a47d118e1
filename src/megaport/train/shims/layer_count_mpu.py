"""``layer-count-mpu``: the legacy model counts its layers through mpu, as upstream's 1a26b2910d made it.

From 42c4071581 (2022-11-02, the commit that moved mpu into megatron/core) until 1a26b2910d
(2022-11-08, "core-fix") ``_get_num_layers`` in ``megatron/model/transformer.py`` called
``get_pipeline_model_parallel_world_size``, ``get_pipeline_model_parallel_rank`` and
``is_pipeline_stage_before_split`` unqualified, names the module no longer imported: GPT, BERT and T5
built nothing (``NameError``). Here the module is handed those names, bound to ``mpu``'s functions,
which are the calls upstream's fix makes. The port fixes the same window in its own way
(``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "layer-count-mpu"
DESCRIPTION = ("main 2022-11-02 … 11-08: the legacy model counted its layers with pipeline functions it no longer "
               "imported (NameError, no model built); mpu's functions, as upstream's 1a26b2910d calls them")
ERAS = "main 2022-11-02 (42c4071581) … 2022-11-08 (1a26b2910d)"
REPRODUCES = "upstream's 1a26b2910d (core-fix)"
NAMES = ("get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank", "is_pipeline_stage_before_split")
PATTERN = (Match(("NameError",), message=r"'(%s)' is not defined" % "|".join(NAMES), file=r"model[/\\]transformer\.py"),)


def names_from_mpu(module) -> None:
    mpu = getattr(module, "mpu", None)
    for name in NAMES:
        if mpu is not None and not hasattr(module, name) and hasattr(mpu, name):
            setattr(module, name, getattr(mpu, name))


def install() -> None:
    after_import("megatron.model.transformer", names_from_mpu)
