"""Proof that a baseline process ran none of the port's code: what it had loaded, reported at exit.

Each process of the baseline (every rank, and any Python that upstream's build steps start) writes
one file into ``$MEGAPORT_BASELINE_AUDIT_DIR``: never to stdout, which upstream's Makefile reads
from ``python3 -m pybind11 --includes``. Torch-free, so the parent reads the reports without
importing the shims."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

AUDIT_DIR_ENV = "MEGAPORT_BASELINE_AUDIT_DIR"
_PORT_MARKS = ("install_import_blocker", "resolve_distributed_backend")  # names only the port's package holds


def port_code_loaded() -> list:
    """The port's code in this process: its package (named ``rocm_port``, from megaport.replacements,
    or defining the port's own functions) and every module inside it (the port is a package: a process
    that loads one of its modules loads it), and finders on sys.meta_path from such modules."""
    modules = list(sys.modules.items())
    packages = [name for name, module in modules
                if name.endswith("rocm_port") or name.startswith("megaport.replacements")
                or all(mark in getattr(module, "__dict__", {}) for mark in _PORT_MARKS)]
    found = [f"module {name}" for name, _ in modules
             if "rocm_port" in name.split(".") or any(name == p or name.startswith(p + ".") for p in packages)]
    flagged = {entry.split(" ", 1)[1] for entry in found}
    for finder in sys.meta_path:
        if type(finder).__module__ in flagged:
            found.append(f"finder {type(finder).__module__}.{type(finder).__qualname__}")
    return found


def report_port_code() -> None:
    """Write what :func:`port_code_loaded` found to ``$MEGAPORT_BASELINE_AUDIT_DIR`` (when set),
    whole or not at all: written beside, then renamed. A rank that torchrun stopped while it wrote
    its report at exit had left an empty ``audit-*.json``, and reading it failed the whole layout
    check (e6-2024-06, GPT tp2-pp2 against unported upstream: ``JSONDecodeError``)."""
    folder = os.environ.get(AUDIT_DIR_ENV)
    if folder and os.path.isdir(folder):
        partial = Path(folder, f"audit-{os.getpid()}.partial")
        partial.write_text(json.dumps(port_code_loaded()), encoding="utf-8")
        os.replace(partial, Path(folder, f"audit-{os.getpid()}.json"))


def read(folder) -> list | None:
    """Every port module or finder the processes reported in ``folder``; None when none reported."""
    reports = [json.loads(p.read_text(encoding="utf-8")) for p in Path(folder).glob("audit-*.json")]
    return None if not reports else sorted({entry for report in reports for entry in report})
