"""Code megaport injects into upstream trees, kept here as the single source of truth.

``rocm_port.py`` in this package is copied, after rendering its era constants, as a new
file ``megatron/core/rocm_port.py`` into every patched tree; upstream files get small
hunks that import from it.  It is data for the series generator, never imported by
megaport itself (it would install its import blocker into megaport's process).
"""

from __future__ import annotations

import ast
from pathlib import Path

TREE_PATH = "megatron/core/rocm_port.py"

_SOURCE = Path(__file__).with_name("rocm_port.py")
# Era constants: each is one line ``NAME = True`` in the source (its newest form); render()
# turns it to False for the series whose catalogue entry says so.
ERA_CONSTANTS = ("FULLY_MASKED_ROWS_ARE_ZERO", "TRANSFORMER_ENGINE_IMPORTS_GUARDED")


def port_constant(name: str):
    """A literal constant of ``rocm_port.py`` (the modules it blocks, say), read from its text: the
    port defines it once, for the trees it is copied into, and megaport's checks read the same
    value without importing the module (which would install its blocker here)."""
    for node in ast.parse(source_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{_SOURCE} defines no constant {name}")


def source_text() -> str:
    """The raw text of ``rocm_port.py`` (era constants in their default, newest form)."""
    return _SOURCE.read_text(encoding="utf-8")


def render(*, fully_masked_rows_are_zero: bool, transformer_engine_imports_guarded: bool = True,
           tree_path: str = TREE_PATH) -> str:
    """The module text for one upstream era.

    ``fully_masked_rows_are_zero`` is False for trees older than upstream commit
    76db958327 (2022-07-28), whose masked-softmax kernel gave fully masked rows a
    uniform distribution instead of zeros. ``transformer_engine_imports_guarded`` is False
    for the eras (2023-07 to 2024-06) whose megatron/core imports TransformerEngine layers at
    module level with no guard. ``tree_path`` is where the series puts the module
    (``megatron/rocm_port.py`` in trees older than megatron/core), so its docstring and error
    messages name the file the user actually has.
    """
    text = source_text().replace(TREE_PATH, tree_path)
    values = {"FULLY_MASKED_ROWS_ARE_ZERO": fully_masked_rows_are_zero,
              "TRANSFORMER_ENGINE_IMPORTS_GUARDED": transformer_engine_imports_guarded}
    lines = text.splitlines(keepends=True)
    for name in ERA_CONSTANTS:
        line_true = f"{name} = True"
        hits = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == line_true]
        if len(hits) != 1:
            raise ValueError(f"{_SOURCE}: expected the line {line_true!r} exactly once, found it {len(hits)} times")
        if not values[name]:
            i = hits[0]
            lines[i] = f"{name} = False" + lines[i][len(line_true):]
    return "".join(lines)
