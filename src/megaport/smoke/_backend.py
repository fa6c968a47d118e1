"""The tree's ``--distributed-backend`` default, wherever its era declares it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from megaport.smoke._locate import ROCM_PORT_MODULES, import_first

if TYPE_CHECKING:
    from megaport.smoke._era import Upstream


def distributed_backend_default(tree: Path, upstream: Upstream | None = None) -> tuple[str, str]:
    """The tree's ``--distributed-backend`` default and where it came from.

    E1–E6 declare it in arguments.py (megatron/ or megatron/training/); E7–E8 in
    megatron/training/config/common_config.py. PyPI-built trees have neither, and the value the
    series installs there is rocm_port.default_distributed_backend(): that is used then. Which
    files the era has is upstream's answer (``upstream``) where it can be read.
    """
    import argparse

    from megaport.train.example import ARGUMENT_FILES, CONFIG_FILES

    def era_has(path: str) -> bool:
        found = upstream.has(path) if upstream is not None else None
        return (tree / path).is_file() if found is None else found

    for rel in ARGUMENT_FILES:
        if not era_has(rel):
            continue
        name = rel[:-len(".py")].replace("/", ".")
        try:
            module = importlib.import_module(name)
            parser = argparse.ArgumentParser(allow_abbrev=False)
            module._add_distributed_args(parser)
            value = parser.get_default("distributed_backend")
            if value:
                return str(value), f"{name.replace('.', '/')}.py --distributed-backend default"
        except Exception:  # noqa: BLE001 - a training module this machine cannot import: next source
            continue
    if era_has(CONFIG_FILES[0]):
        try:
            module = importlib.import_module(CONFIG_FILES[0][:-len(".py")].replace("/", "."))
            import dataclasses

            for cls in vars(module).values():
                if dataclasses.is_dataclass(cls):
                    for f in dataclasses.fields(cls):
                        if f.name == "distributed_backend" and f.default is not dataclasses.MISSING:
                            return str(f.default), "megatron/training/config/common_config.py default"
        except Exception:  # noqa: BLE001
            pass
    rocm_port, _ = import_first(ROCM_PORT_MODULES)
    if rocm_port is not None and hasattr(rocm_port, "default_distributed_backend"):
        return rocm_port.default_distributed_backend(), "rocm_port.default_distributed_backend() (no megatron/training here)"
    return "nccl", "upstream's default (no rocm_port backend helper in this tree)"
