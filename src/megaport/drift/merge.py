"""Three-way merge of one file, the way ``git merge-file`` (and ``git am -3``) does it.

base is the patch's preimage (its ``index`` line's old blob), ours the preimage with the patch's
hunks applied, theirs upstream's current file. A clean merge is upstream's file with the patch's
change in it.
"""

from __future__ import annotations

from typing import Optional

from megaport.git import merge_file


def merge3(base: bytes, ours: bytes, theirs: bytes) -> tuple[Optional[bytes], int]:
    """``(merged, 0)`` for a clean merge, ``(None, conflicts)`` otherwise."""
    if ours == base:
        return theirs, 0
    if theirs == base or theirs == ours:
        return ours, 0
    # merge-file <current> <base> <other>: the changes base -> other go into current.
    return merge_file(theirs, base, ours)
