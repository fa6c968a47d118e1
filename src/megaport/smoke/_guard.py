"""The import guard: apex, amp_C and the fused ``*_cuda`` extensions stay out of the process.

After every test no blocked module may be in sys.modules (conftest's hook), and raising stand-ins
first on sys.path catch an import that gets past the port's blocker, even where apex is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megaport.replacements import port_constant

# What the port must keep out of the process: apex, amp_C and every fused "*_cuda" extension,
# as the port itself lists them.
BLOCKED_EXACT = port_constant("_BLOCKED_EXACT")
BLOCKED_SUFFIX = port_constant("_BLOCKED_SUFFIX")
# Stand-ins put first on sys.path: a real install of any of these is shadowed by a module that
# raises when imported, so an import that gets past the port's blocker fails loudly.
STAND_INS = (
    "apex", "amp_C", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
    "scaled_softmax_cuda", "generic_scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda",
    "fused_layer_norm_cuda", "fused_mix_prec_layer_norm_cuda", "fused_dense_cuda",
)
STAND_IN_MARK = "megaport verify stand-in"


def is_blocked(name: str) -> bool:
    top = name.partition(".")[0]
    return top in BLOCKED_EXACT or top.endswith(BLOCKED_SUFFIX)


def blocked_modules_loaded() -> list[str]:
    return sorted(name for name, module in list(sys.modules.items()) if module is not None and is_blocked(name))


def write_stand_ins(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in STAND_INS:
        package = folder / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(
            f"raise RuntimeError({STAND_IN_MARK + ': ' + name + ' was imported; the ported tree must never load it'!r})\n",
            encoding="utf-8",
        )
    return folder
