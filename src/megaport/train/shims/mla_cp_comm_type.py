"""``mla-cp-comm-type``: MLASelfAttention takes TransformerLayer's ``cp_comm_type``, as upstream's 60d5b383fa.

From 2bdc60c4af (2024-11-15), where ``--cp-comm-type`` came to default to ``p2p``,
``TransformerLayer`` built its self-attention with ``cp_comm_type``; ``Attention.__init__`` took it,
``MLASelfAttention.__init__`` did not until 60d5b383fa (2024-12-07), so every MLA model (DeepSeek)
built nothing: ``TypeError: MLASelfAttention.__init__() got an unexpected keyword argument
'cp_comm_type'``, on any machine. Here the class's constructor is given the keyword and leaves it
out; upstream's fix hands it to the core attention, whose local (no-TE) kind takes it unused. The
port fixes the same window in its own way (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "mla-cp-comm-type"
DESCRIPTION = ("main 2024-11-15 … 12-07: TransformerLayer built MLA with cp_comm_type, which its constructor did not "
               "take (TypeError, DeepSeek built nothing); the keyword taken, left to the config, as upstream's "
               "60d5b383fa takes it")
ERAS = "main 2024-11-15 (2bdc60c4af) … 2024-12-07 (60d5b383fa)"
REPRODUCES = "upstream's 60d5b383fa (MLASelfAttention takes cp_comm_type)"
PATTERN = (Match(("TypeError",), message=r"MLASelfAttention\.__init__\(\) got an unexpected keyword argument "
                                         r"'cp_comm_type'"),)


def cp_comm_type_taken(module) -> None:
    cls = module.MLASelfAttention
    init = cls.__init__

    def init_with_cp_comm_type(self, *args, cp_comm_type=None, **kwargs):
        init(self, *args, **kwargs)

    cls.__init__ = init_with_cp_comm_type


def install() -> None:
    after_import("megatron.core.transformer.multi_latent_attention", cp_comm_type_taken)
