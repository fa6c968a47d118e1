"""``bert-te-spec``: BERT's TE layer spec gives Megatron's local layers (core 0.10 on).

From 2024-11 ``pretrain_bert.py`` imports ``bert_layer_with_transformer_engine_spec`` at module
level, which ``bert_layer_specs``' module ``__getattr__`` builds on the spot, and without TE that
raises ("Please use local Bert layer spec instead") before ``--spec local`` is even read. A user
without TE edits the import away; here the TE spec's builder gives the local spec the module
defines, the model ``--spec local`` trains.
"""

from __future__ import annotations

from megaport.train.hooks import after_import, before_import
from megaport.train.shims._pattern import Match

NAME = "bert-te-spec"
DESCRIPTION = ("BERT's TE layer spec builder gives the module's local spec (from 2024-11 pretrain_bert.py builds the "
               "TE spec at import, before --spec local is read, and without TE that raises: what a user without TE "
               "edits away)")
ERAS = "core 0.9 on (main 2024-10 … 2026-05)"
REPRODUCES = "a user's edit of pretrain_bert.py's import of the TE spec"
PATTERN = (Match(("ImportError",), message=r"Please use local Bert layer spec", file=r"bert_layer_specs\.py$"),
           Match(("NameError",), message=r"name 'TE\w+' is not defined", file=r"bert_layer_specs\.py$"))
_SPECS = "megatron.core.models.bert.bert_layer_specs"
#: the TE layers core 0.9's module-level TE spec names
TE_LAYER_NAMES = ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear")


def _not_without_te(name: str) -> type:
    def refuse(self, *args, **kwargs):
        raise ImportError(f"{name} needs TransformerEngine, which is not installed (bert-te-spec shim)")

    return type(name, (), {"__init__": refuse, "__module__": _SPECS})


def te_layer_names(module) -> None:
    for name in TE_LAYER_NAMES:
        module.__dict__.setdefault(name, _not_without_te(name))


def local_spec_for_bert_te_spec(module) -> None:
    local = module.bert_layer_local_spec
    module.get_bert_layer_with_transformer_engine_spec = lambda: local


def install() -> None:
    before_import(_SPECS, te_layer_names)
    after_import(_SPECS, local_spec_for_bert_te_spec)
