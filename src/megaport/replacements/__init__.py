"""Code megaport injects into upstream trees, kept here as the single source of truth.

The package ``rocm_port/`` here is copied, after rendering its era constants, as a new
package ``megatron/core/rocm_port/`` into every patched tree; upstream files get small
hunks that import from it.  It is data for the series generator, never imported by
megaport itself (it would install its import blocker into megaport's process).
"""

from __future__ import annotations

import ast
from pathlib import Path

# Where the base series put the package in a tree (its folder).
TREE_PATH = "megatron/core/rocm_port"

_SOURCE = Path(__file__).with_name("rocm_port")
# Era constants: each is one line ``NAME = True`` in the package (its newest form), in one module;
# render() turns it to False for the series whose catalogue entry says so.
ERA_CONSTANTS = ("FULLY_MASKED_ROWS_ARE_ZERO", "TRANSFORMER_ENGINE_IMPORTS_GUARDED")


def module_files() -> list[str]:
    """The package's files, in the order git lists them (``__init__.py`` first)."""
    return sorted(p.name for p in _SOURCE.glob("*.py"))


def source_text(name: str) -> str:
    """The raw text of one module of the package (``"softmax.py"``; era constants in their newest form)."""
    return (_SOURCE / name).read_text(encoding="utf-8")


def sources() -> dict[str, str]:
    """Every module's raw text, by file name."""
    return {name: source_text(name) for name in module_files()}


def port_constant(name: str):
    """A literal constant of the port (the modules it blocks, say), read from its text: the port
    defines it once, for the trees it is copied into, and megaport's checks read the same value
    without importing the package (which would install its blocker here)."""
    found = []
    for file, text in sources().items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                found.append((file, ast.literal_eval(node.value)))
    if len(found) != 1:
        raise KeyError(f"{_SOURCE} defines the constant {name} {len(found)} times, not once")
    return found[0][1]


def render(*, fully_masked_rows_are_zero: bool, transformer_engine_imports_guarded: bool = True,
           tree_path: str = TREE_PATH) -> dict[str, str]:
    """The package's files for one upstream era: ``{path in the tree: text}``, in git's order.

    ``fully_masked_rows_are_zero`` is False for trees older than upstream commit
    76db958327 (2022-07-28), whose masked-softmax kernel gave fully masked rows a
    uniform distribution instead of zeros. ``transformer_engine_imports_guarded`` is False
    for the eras (2023-07 to 2024-06) whose megatron/core imports TransformerEngine layers at
    module level with no guard. ``tree_path`` is the package's folder in the tree
    (``megatron/rocm_port`` in trees older than megatron/core), so its docstring and error
    messages name the place the user actually has.
    """
    values = {"FULLY_MASKED_ROWS_ARE_ZERO": fully_masked_rows_are_zero,
              "TRANSFORMER_ENGINE_IMPORTS_GUARDED": transformer_engine_imports_guarded}
    files = {name: text.replace(TREE_PATH, tree_path).splitlines(keepends=True) for name, text in sources().items()}
    for name in ERA_CONSTANTS:
        line_true = f"{name} = True"
        hits = [(file, i) for file, lines in files.items() for i, line in enumerate(lines)
                if line.rstrip("\r\n") == line_true]
        if len(hits) != 1:
            raise ValueError(f"{_SOURCE}: expected the line {line_true!r} exactly once, found it {len(hits)} times")
        if not values[name]:
            file, i = hits[0]
            files[file][i] = f"{name} = False" + files[file][i][len(line_true):]
    return {f"{tree_path}/{name}": "".join(lines) for name, lines in files.items()}
