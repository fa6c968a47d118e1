"""Loading megaport's port package (or a rendered copy of it) under a fresh name, as upstream
imports it: a package whose modules import each other relatively."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

import megaport.replacements as replacements

SOURCE = replacements._SOURCE


def load(files: dict | None = None, folder: Path | None = None, prefix: str = "_rocm_port_under_test"):
    """Import the package, or ``files`` (render()'s ``{path: text}``) written into ``folder``, under a
    fresh name; its blocker is installed as the tree's would be (uninstall_import_blocker() removes it)."""
    name = f"{prefix}_{uuid.uuid4().hex}"
    where = SOURCE
    if files is not None:
        where = folder / name
        where.mkdir(parents=True)
        for path, text in files.items():
            (where / Path(path).name).write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, where / "__init__.py", submodule_search_locations=[str(where)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its relative imports find the package here
    spec.loader.exec_module(module)
    return module
