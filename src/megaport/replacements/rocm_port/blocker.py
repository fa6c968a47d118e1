"""The import blocker: apex, amp_C and the ``*_cuda`` extensions are refused, so every guarded
``try: import apex ... except ImportError`` in upstream takes its PyTorch route, even where a ROCm
apex build is installed. Its mark is how every copy of the port recognises an installed blocker.

A probe is not an import: ``importlib.util.find_spec("apex")`` (transformers asks it at import)
must answer "not installed", never raise. A finder cannot hide an installed module by answering
None (the next finder finds it), so the names upstream imports are marked absent in
``sys.modules`` (None: a probe gets None, an import ModuleNotFoundError); the finder refuses the
rest (other ``*_cuda`` names, submodules once a mark is gone)."""

from __future__ import annotations

import importlib.abc
import sys

_BLOCKED_EXACT = ("apex", "amp_C")
_BLOCKED_SUFFIX = "_cuda"
_BLOCKER_MARK = "_megatron_rocm_port_import_blocker"
#: the blocked modules upstream imports (apex, amp_C, the fused kernels' extensions): absent to a probe
_MARKED_ABSENT = (
    "apex", "amp_C", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
    "scaled_softmax_cuda", "generic_scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda",
    "fused_layer_norm_cuda", "fused_mix_prec_layer_norm_cuda", "fused_dense_cuda",
)


def _is_blocked(top_level_name: str) -> bool:
    return top_level_name in _BLOCKED_EXACT or top_level_name.endswith(_BLOCKED_SUFFIX)


class _ImportBlocker(importlib.abc.MetaPathFinder):
    """Refuses apex, amp_C and ``*_cuda`` extension modules (and their submodules)."""

    _megatron_rocm_port_import_blocker = True

    def find_spec(self, fullname, path=None, target=None):
        if _is_blocked(fullname.partition(".")[0]):
            raise ModuleNotFoundError(
                f"{fullname} is disabled by the ROCm port (megatron/core/rocm_port): "
                "Megatron runs on PyTorch here",
                name=fullname,
            )
        return None


def install_import_blocker() -> None:
    """Put the blocker first on ``sys.meta_path`` and mark upstream's blocked imports absent;
    installing twice is a no-op."""
    if not any(getattr(f, _BLOCKER_MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportBlocker())
    for name in _MARKED_ABSENT:
        sys.modules.setdefault(name, None)


def uninstall_import_blocker() -> None:
    """Remove every blocker installed by any copy of the port, and its absent marks."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _BLOCKER_MARK, False)]
    for name in _MARKED_ABSENT:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def blocked_modules_loaded() -> list:
    """Blocked modules that were imported before the blocker was installed."""
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if module is not None and _is_blocked(name.partition(".")[0])
    )
