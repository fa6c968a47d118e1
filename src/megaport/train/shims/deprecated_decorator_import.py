"""``deprecated-decorator-import``: the MoE experts import upstream's deprecation decorator from where it is, as upstream's 4bdd7b10e6 does.

On main at 5f5741db9b (2025-12-16 15:49, "M4 + Dist Checkpoint: Replace global parallel state with
explicit group parameters") ``megatron/core/transformer/moe/experts.py`` imported ``deprecated``
from ``megatron.core.backwards_compatibility_decorators``, a module upstream never had; every import
of ``megatron.core`` reaches the experts module, so nothing imported (``ModuleNotFoundError``) until
the next commit, 4bdd7b10e6 ("fix deprecated decorator import"), imported it from
``megatron.core.utils``. Here the module's source line is replaced by the fix's before the module
runs. The port fixes the same window in its own way (``rocm_port.upstream_fixes._SOURCE_FIXES``).
"""

from __future__ import annotations

from megaport.train.shims._import_guard import import_guard
from megaport.train.shims._pattern import Match

NAME = "deprecated-decorator-import"
DESCRIPTION = ("main 2025-12-16 (5f5741db9b, until the next commit 4bdd7b10e6): the MoE experts imported the "
               "deprecation decorator from a module upstream never had, so megatron.core imported nowhere; imported "
               "from megatron.core.utils, as upstream's 4bdd7b10e6")
ERAS = "main 2025-12-16 (5f5741db9b … 4bdd7b10e6)"
REPRODUCES = "upstream's 4bdd7b10e6 (fix deprecated decorator import)"
MODULE = "megatron.core.transformer.moe.experts"
FILE = "megatron/core/transformer/moe/experts.py"
BROKEN = "\nfrom megatron.core.backwards_compatibility_decorators import deprecated\n"
FIXED = "\nfrom megatron.core.utils import deprecated\n"
PATTERN = (Match(("ModuleNotFoundError",), module=r"megatron\.core\.backwards_compatibility_decorators"),)


applies, moved_import, install = import_guard(MODULE, FILE, BROKEN, FIXED)
