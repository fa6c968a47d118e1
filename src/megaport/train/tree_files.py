"""Reading an upstream tree's own files: what an era's code says decides a run's flags, sizes and
baseline shims (a family's script, the parser, a kernel's semantics, an upstream bug). One reader,
so every such check treats a missing file and the encoding alike."""

from __future__ import annotations

import os


def tree_text(tree: str, *candidates: str) -> str | None:
    """The text of the first of ``candidates`` (paths inside ``tree``, newest layout first) that the
    tree has; None when it has none of them."""
    for rel in candidates:
        path = os.path.join(tree, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
    return None


def tree_says(tree: str, rel: str, text: str) -> bool:
    """Whether the tree's file ``rel`` contains ``text`` (False where the tree lacks the file)."""
    found = tree_text(tree, rel)
    return found is not None and text in found
