"""Reading an upstream tree's own files: what an era's code says decides a run's flags, sizes and
baseline shims (a family's script, the parser, a kernel's semantics, an upstream bug). One reader,
so every such check treats a missing file and the encoding alike."""

from __future__ import annotations

import os


def first_file(tree: str, *candidates: str) -> str | None:
    """The first of ``candidates`` (paths inside ``tree``, newest layout first) that the tree has;
    None when it has none of them."""
    return next((rel for rel in candidates if os.path.isfile(os.path.join(tree, rel))), None)


def tree_text(tree: str, *candidates: str) -> str | None:
    """The text of the first of ``candidates`` that the tree has (:func:`first_file`); None when it
    has none of them."""
    rel = first_file(tree, *candidates)
    if rel is None:
        return None
    with open(os.path.join(tree, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def tree_says(tree: str, rel: str, text: str) -> bool:
    """Whether the tree's file ``rel`` contains ``text`` (False where the tree lacks the file)."""
    found = tree_text(tree, rel)
    return found is not None and text in found
