"""The pure patch engine: patch text and file contents in, results and new contents out.

No git, no file system, no subprocess here: callers supply a ``read(path)`` function and
write ``PatchResult.changes`` themselves, which keeps the engine easy to test exhaustively.
"""

from .apply import apply_patch, apply_series, reverse_patch
from .diff import make_file_diff
from .errors import PatchFormatError, UnsafePathError
from .model import FilePatch, FileResult, Hunk, HunkResult, Patch, PatchResult
from .parse import parse_patch
from .paths import check_patch_paths, is_within
from .place import Placement, locate, nearest

__all__ = [
    "FilePatch",
    "FileResult",
    "Hunk",
    "HunkResult",
    "Patch",
    "PatchFormatError",
    "PatchResult",
    "Placement",
    "UnsafePathError",
    "apply_patch",
    "apply_series",
    "check_patch_paths",
    "is_within",
    "locate",
    "make_file_diff",
    "nearest",
    "parse_patch",
    "reverse_patch",
]
