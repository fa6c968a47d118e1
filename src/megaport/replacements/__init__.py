"""Code megaport injects into upstream trees, kept here as the single source of truth.

``rocm_port.py`` in this package is copied, after rendering its era constant, as a new
file ``megatron/core/rocm_port.py`` into every patched tree; upstream files get small
hunks that import from it.  It is data for the series generator, never imported by
megaport itself (it would install its import blocker into megaport's process).
"""

from __future__ import annotations

from pathlib import Path

TREE_PATH = "megatron/core/rocm_port.py"

_SOURCE = Path(__file__).with_name("rocm_port.py")
_ERA_LINE_TRUE = "FULLY_MASKED_ROWS_ARE_ZERO = True"
_ERA_LINE_FALSE = "FULLY_MASKED_ROWS_ARE_ZERO = False"


def source_text() -> str:
    """The raw text of ``rocm_port.py`` (era constant in its default, newest form)."""
    return _SOURCE.read_text(encoding="utf-8")


def render(*, fully_masked_rows_are_zero: bool, tree_path: str = TREE_PATH) -> str:
    """The module text for one upstream era.

    ``fully_masked_rows_are_zero`` is False for trees older than upstream commit
    76db958327 (2022-07-28), whose masked-softmax kernel gave fully masked rows a
    uniform distribution instead of zeros. ``tree_path`` is where the series puts the
    module (``megatron/rocm_port.py`` in trees older than megatron/core), so its
    docstring and error messages name the file the user actually has.
    """
    text = source_text().replace(TREE_PATH, tree_path)
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == _ERA_LINE_TRUE]
    if len(hits) != 1:
        raise ValueError(
            f"{_SOURCE}: expected the line {_ERA_LINE_TRUE!r} exactly once, "
            f"found it {len(hits)} times"
        )
    if not fully_masked_rows_are_zero:
        i = hits[0]
        ending = lines[i][len(_ERA_LINE_TRUE):]
        lines[i] = _ERA_LINE_FALSE + ending
    return "".join(lines)
