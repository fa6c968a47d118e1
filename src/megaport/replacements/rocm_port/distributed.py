"""The distributed backend: ``--distributed-backend rccl`` accepted, and torch's ``'nccl'`` (which
on a ROCm build of PyTorch *is* RCCL) named for what it is."""

from __future__ import annotations

import torch

DISTRIBUTED_BACKENDS = ["nccl", "gloo", "rccl"]


def default_distributed_backend() -> str:
    return "rccl" if getattr(torch.version, "hip", None) else "nccl"


def collective_library() -> tuple:
    """``("RCCL" | "NCCL", "major.minor.patch" or None)``; never raises."""
    name = "RCCL" if getattr(torch.version, "hip", None) else "NCCL"
    version = None
    try:
        v = torch.cuda.nccl.version()
        if isinstance(v, (tuple, list)):
            version = ".".join(str(int(p)) for p in v)
        elif isinstance(v, int):
            # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, else *1000.
            if v >= 10000:
                version = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
            else:
                version = f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"
    except Exception:
        version = None
    return name, version


def resolve_distributed_backend(name: str, rank: int = 0) -> str:
    """The torch backend string for ``--distributed-backend``: 'rccl' is torch's 'nccl'."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DISTRIBUTED_BACKENDS:
        raise ValueError(
            f"unknown distributed backend {name!r}: expected one of "
            + ", ".join(repr(b) for b in DISTRIBUTED_BACKENDS)
            + " ('rccl' runs through torch's 'nccl' backend on ROCm)"
        )
    torch_backend = "nccl" if key == "rccl" else key
    if torch_backend == "nccl" and rank == 0:
        lib, version = collective_library()
        print(
            f"> ROCm port: distributed backend {key!r} -> torch 'nccl' "
            f"({lib} {version or 'version unknown'})",
            flush=True,
        )
    return torch_backend
