"""``grouped-gemm``: the ``grouped_gemm`` package (``ops.gmm``) as one matmul per expert.

With ``--moe-grouped-gemm`` and no TE, upstream of 2024-2025 builds its legacy GroupedMLP, which
asserts the package is installed. Written from the package's documented contract (rows of ``a``
taken ``batch_sizes[e]`` at a time, times ``b[e]`` or its transpose), apart from the port's gmm.
"""

from __future__ import annotations

import sys
import types

import torch

from megaport.train.shims._pattern import Match

NAME = "grouped-gemm"
DESCRIPTION = "the grouped_gemm package's gmm as a per-expert loop of matmuls (autograd for the backward)"
ERAS = "E6 (main 2024-06 … 2025-11, --moe-grouped-gemm with the local spec)"
REPRODUCES = "grouped_gemm (fanshiqing/grouped_gemm) ops.gmm"
PATTERN = (Match(("AssertionError",), message=r"Grouped GEMM is not available"),)


def gmm(a, b, batch_sizes, trans_b=False):
    start, out = 0, []
    for expert, rows in enumerate(int(n) for n in batch_sizes):
        w = b[expert].t() if trans_b else b[expert]
        out.append(torch.matmul(a[start:start + rows], w))
        start += rows
    return torch.cat(out, dim=0)


def install() -> None:
    package = types.ModuleType("grouped_gemm")
    package.ops = types.SimpleNamespace(gmm=gmm)
    sys.modules.setdefault("grouped_gemm", package)
