"""Reading an upstream tree's own files: what an era's code says decides a run's flags, sizes,
layouts and baseline shims (a family's script, the parser, a kernel's semantics, an upstream bug).
One reader, so every such check treats a missing file and the encoding alike.

Era facts come from the unported upstream commit a ported tree records (``state.json``'s
``upstream_sha``, read from the tree's own git), never from the ported files: a series that broke
``--swiglu`` in the parser must make Llama fail in verify, not vanish from it. A folder that
records no commit (an exported baseline, a tree megaport did not port) is read as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

#: (tree, path) -> text or None, for trees read through their unported commit
_TEXTS: dict = {}
#: tree -> its unported commit, or "" where it records none
_COMMITS: dict = {}


def unported_commit(tree: str) -> str:
    """The unported upstream commit ``tree`` records and its git holds ("" where it records none,
    or the commit cannot be read: then the tree's files are all there is, as the smoke suite's
    era decisions fall back to them)."""
    if tree not in _COMMITS:
        from megaport.git import BlobReader, GitError
        from megaport.porttree import read_state

        state = read_state(Path(tree))
        sha = (state.upstream_sha or "") if state is not None else ""
        if sha:
            try:
                BlobReader(tree, sha).close()
            except (GitError, OSError):
                sha = ""
        _COMMITS[tree] = sha
    return _COMMITS[tree]


#: (tree, commit) -> the folder it is exported to, kept for the process
_EXPORTS: dict = {}


def exported(tree: str, sha: str) -> str:
    """Commit ``sha`` of ``tree``'s git exported to a folder kept for this process (removed at
    exit): the parser probe and every baseline run of a verify share one export, and with it the
    parser's option list and upstream's dataset helpers built in it once."""
    key = (tree, sha)
    if key not in _EXPORTS:
        import atexit
        import shutil
        import tempfile

        from megaport.git import export_commit

        folder = tempfile.mkdtemp(prefix="megaport-upstream-")
        atexit.register(shutil.rmtree, folder, True)
        export_commit(tree, sha, folder)
        _EXPORTS[key] = folder
    return _EXPORTS[key]


def _upstream_text(tree: str, sha: str, rel: str) -> str | None:
    key = (tree, sha, rel)
    if key not in _TEXTS:
        from megaport.git import BlobReader

        with BlobReader(tree, sha) as commit:
            data = commit.read(rel)
        _TEXTS[key] = None if data is None else data.decode("utf-8", "replace")
    return _TEXTS[key]


def _text(tree: str, rel: str) -> str | None:
    sha = unported_commit(tree)
    if sha:
        return _upstream_text(tree, sha, rel)
    path = os.path.join(tree, rel)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def first_file(tree: str, *candidates: str) -> str | None:
    """The first of ``candidates`` (paths inside ``tree``, newest layout first) that the tree's era
    has; None when it has none of them."""
    return next((rel for rel in candidates if _text(tree, rel) is not None), None)


def tree_text(tree: str, *candidates: str) -> str | None:
    """The text of the first of ``candidates`` that the tree's era has (:func:`first_file`); None
    when it has none of them."""
    rel = first_file(tree, *candidates)
    return None if rel is None else _text(tree, rel)


def tree_says(tree: str, rel: str, text: str) -> bool:
    """Whether the era's file ``rel`` contains ``text`` (False where the era lacks the file)."""
    found = tree_text(tree, rel)
    return found is not None and text in found
