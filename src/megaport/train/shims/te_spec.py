"""``te-spec``: core 0.4-0.5's TE GPT layer spec builds Megatron's local layers.

That era's ``pretrain_gpt.py`` builds the TE layer spec whatever ``--transformer-impl`` says, and
its ``--spec`` takes no builder; with the TE stub that model cannot be built. A user without TE
edits it to take the local spec: the same model, the one the port builds there. With grouped-query
attention (core 0.5's Mixtral) the TE attention refuses the stub's version before it asks the stub
for anything; the same edit answers that too.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "te-spec"
DESCRIPTION = ("the TE GPT layer spec builds Megatron's local layers (core 0.4-0.5's pretrain_gpt.py takes the TE "
               "spec whatever --transformer-impl says and its --spec takes no builder: what a user without TE "
               "edits it to do; the model the port builds)")
ERAS = "E4 (core 0.4-0.5, main 2023-10 … 2024-02)"
REPRODUCES = "a user's one-line edit of pretrain_gpt.py to the local spec"
# The TE stub refused a TE layer the spec asked for (build_module re-raises it with its own words),
# or TEDotProductAttention refused grouped-query attention by the stub's version before asking it
# for anything ("Transformer Engine v0.0.0+megaport.stub does not support Grouped Query Attention").
PATTERN = (Match(("TransformerEngineStubUsed",)),
           Match(("ValueError",), message=r"megaport\.stub does not support Grouped Query Attention"))


def local_spec_for_te_spec(module) -> None:
    module.get_gpt_layer_with_transformer_engine_spec = module.get_gpt_layer_local_spec


def install() -> None:
    after_import("megatron.core.models.gpt.gpt_layer_specs", local_spec_for_te_spec)
