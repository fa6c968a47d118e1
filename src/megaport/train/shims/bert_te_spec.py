"""``bert-te-spec``: BERT's TE layer spec gives Megatron's local layers (core 0.10 on).

From 2024-11 ``pretrain_bert.py`` imports ``bert_layer_with_transformer_engine_spec`` at module
level, which ``bert_layer_specs``' module ``__getattr__`` builds on the spot, and without TE that
raises ("Please use local Bert layer spec instead") before ``--spec local`` is even read. A user
without TE edits the import away; here the TE spec's builder gives the local spec the module
defines, the model ``--spec local`` trains.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "bert-te-spec"
DESCRIPTION = ("BERT's TE layer spec builder gives the module's local spec (from 2024-11 pretrain_bert.py builds the "
               "TE spec at import, before --spec local is read, and without TE that raises: what a user without TE "
               "edits away)")
ERAS = "core 0.10 on (main 2024-11 … 2026-05)"
REPRODUCES = "a user's edit of pretrain_bert.py's import of the TE spec"
PATTERN = (Match(("ImportError",), message=r"Please use local Bert layer spec", file=r"bert_layer_specs\.py$"),)


def local_spec_for_bert_te_spec(module) -> None:
    local = module.bert_layer_local_spec
    module.get_bert_layer_with_transformer_engine_spec = lambda: local


def install() -> None:
    after_import("megatron.core.models.bert.bert_layer_specs", local_spec_for_bert_te_spec)
