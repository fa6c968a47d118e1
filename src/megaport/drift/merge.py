"""Three-way merge of one file, the way ``git merge-file`` (and ``git am -3``) does it.

base is the patch's preimage (its ``index`` line's old blob), ours the preimage with the patch's
hunks applied, theirs upstream's current file. A clean merge is upstream's file with the patch's
change in it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from megaport.git import run_git


def merge3(base: bytes, ours: bytes, theirs: bytes) -> tuple[Optional[bytes], int]:
    """``(merged, 0)`` for a clean merge, ``(None, conflicts)`` otherwise."""
    if ours == base:
        return theirs, 0
    if theirs == base or theirs == ours:
        return ours, 0
    with tempfile.TemporaryDirectory(prefix="megaport-merge-") as tmp:
        paths = []
        for name, data in (("theirs", theirs), ("base", base), ("ours", ours)):
            path = Path(tmp) / name
            path.write_bytes(data)
            paths.append(str(path))
        # merge-file <current> <base> <other>: the changes base -> other go into current.
        proc = run_git(["merge-file", "-p", "--quiet", *paths], tmp, check=False, text=False)
    if proc.returncode == 0:
        return proc.stdout, 0
    return None, max(proc.returncode, 1) if proc.returncode < 128 else 1
