"""``fused-kernel-build``: upstream's start-up build of its CUDA extensions, skipped.

Until 2023 upstream compiles its fused kernels with nvcc at start-up even with its fusions off
(``megatron.fused_kernels.load``); on ROCm ``CUDA_HOME`` is None and the build fails. The
extensions it would build are served by the ``apex`` shim, so the loaders do nothing.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fused-kernel-build"
DESCRIPTION = "upstream's nvcc build of its CUDA extensions at start-up skipped"
ERAS = "E1-E4 (until 2024-03: fused_kernels.load at start-up)"
REPRODUCES = "a user without nvcc commenting out the build (the apex shim serves its extensions)"
# Whatever the build raised (no CUDA_HOME, no nvcc, a failed compile), raised inside the loader.
PATTERN = (Match(None, file=r"megatron/(legacy/)?fused_kernels/__init__\.py$"),
           Match(("OSError", "RuntimeError", "EnvironmentError"), message=r"CUDA_HOME|nvcc"))
FUSED_KERNELS = ("megatron.fused_kernels", "megatron.legacy.fused_kernels")


def skip_kernel_build(module) -> None:
    """The package's ``load*`` functions do nothing."""
    for name in [n for n in vars(module) if n.startswith("load")]:
        if callable(getattr(module, name)):
            setattr(module, name, lambda *args, **kwargs: None)


def install() -> None:
    for package in FUSED_KERNELS:
        after_import(package, skip_kernel_build)
