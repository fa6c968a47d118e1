"""``te-projector-import``: the nano-v3-vl snapshot's multimodal projector imports TE's checkpoint unguarded.

The snapshot branch ``nano-v3-vl`` (2026-04-21, fa48608a3d) imports
``checkpoint as te_checkpoint`` from ``transformer_engine.pytorch.distributed`` at the top of
``megatron/core/models/vision/multimodal_projector.py``, which ``megatron.training``'s tokenizer
imports: without TE nothing imports ``megatron.training``
(``ModuleNotFoundError: No module named 'transformer_engine'``). The projector never calls it
(``use_te = False``). Here the line is put inside ``try``, the name None without TE, before the
module runs; the transformer-engine stub cannot stand in (with it the FP8 helpers believe TE is
there and import its tensor classes). The port fixes it its own way
(``rocm_port.upstream_fixes._SOURCE_FIXES``).
"""

from __future__ import annotations

from megaport.train.shims._import_guard import import_guard
from megaport.train.shims._pattern import Match

NAME = "te-projector-import"
DESCRIPTION = ("nano-v3-vl (2026-04-21): the multimodal projector imported TransformerEngine's checkpoint unguarded "
               "(megatron.training imports it) and never calls it; the import guarded, the name None without TE")
ERAS = "the nano-v3-vl snapshot branch (fa48608a3d, 2026-04-21)"
REPRODUCES = "a machine without TransformerEngine, where the projector's unused import is skipped"
MODULE = "megatron.core.models.vision.multimodal_projector"
FILE = "megatron/core/models/vision/multimodal_projector.py"
BROKEN = "\nfrom transformer_engine.pytorch.distributed import checkpoint as te_checkpoint\n"
GUARDED = ("\ntry:\n    from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint\n"
           "except ImportError:\n    te_checkpoint = None\n")
PATTERN = (Match(("ModuleNotFoundError",), module=r"transformer_engine(\..*)?", file=r"multimodal_projector\.py"),)


applies, guarded_import, install = import_guard(MODULE, FILE, BROKEN, GUARDED)
