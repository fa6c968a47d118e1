"""Git blob ids, so a patch's ``index old..new`` line can tell which file version it expects.

This is what lets the applier recognise an already-applied patch even when the forward hunks
would also match the patched file (repetitive code makes that common).
"""

from __future__ import annotations

import hashlib
import re
from typing import Optional

_HEX = re.compile(r"^[0-9a-f]{4,64}$")


def git_blob_id(data: bytes) -> str:
    """The SHA-1 git gives a file with this content (``git hash-object``)."""
    header = b"blob %d\0" % len(data)
    return hashlib.sha1(header + data).hexdigest()


def is_null_blob(blob: Optional[str]) -> bool:
    """``0000000`` is how git writes "no file" on the missing side of a create/delete."""
    return blob is not None and set(blob) == {"0"}


def blob_matches(data: bytes, blob: Optional[str]) -> bool:
    """True when ``blob`` (full or abbreviated, as in ``index`` lines) names ``data``."""
    if blob is None or is_null_blob(blob) or not _HEX.match(blob):
        return False
    return git_blob_id(data).startswith(blob)
