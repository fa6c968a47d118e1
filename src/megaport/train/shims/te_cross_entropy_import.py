"""``te-cross-entropy-import``: language_module imports TE's parallel cross entropy where TE is installed, as upstream's 028729b9bc does.

On main from eaf9408232 (2025-03-08) until 028729b9bc (2025-03-15)
``megatron/core/models/common/language_module/language_module.py`` imported
``te_parallel_cross_entropy`` from ``megatron.core.extensions.transformer_engine`` at module level,
unguarded, and that module imports TransformerEngine first thing: without TE no model imported
(``ModuleNotFoundError: No module named 'transformer_engine'``), and the converter loaded nothing.
Here the module's source line is replaced by upstream's guarded import before the module runs. The
port fixes the same window in its own way (``rocm_port.upstream_fixes._SOURCE_FIXES``).
"""

from __future__ import annotations

from megaport.train.shims._import_guard import import_guard
from megaport.train.shims._pattern import Match

NAME = "te-cross-entropy-import"
DESCRIPTION = ("main 2025-03-08 (eaf9408232) … 2025-03-15 (028729b9bc): language_module imported TransformerEngine's "
               "parallel cross entropy unguarded, so no model imported without TE; the import guarded, as upstream's "
               "028729b9bc")
ERAS = "main 2025-03-08 (eaf9408232) … 2025-03-15 (028729b9bc)"
REPRODUCES = "upstream's 028729b9bc (fix_te_import_at_frontend)"
MODULE = "megatron.core.models.common.language_module.language_module"
FILE = "megatron/core/models/common/language_module/language_module.py"
# at the start of a line: the guarded import of the fix holds the same words indented
BROKEN = "\nfrom megatron.core.extensions.transformer_engine import te_parallel_cross_entropy\n"
FIXED = ("\ntry:\n    from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy\n"
         "except ImportError:\n    te_parallel_cross_entropy = None\n")
PATTERN = (Match(("ModuleNotFoundError",), module=r"transformer_engine(\..*)?", file=r"language_module\.py"),)


applies, guarded_import, install = import_guard(MODULE, FILE, BROKEN, FIXED)
