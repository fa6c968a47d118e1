"""Immutable values passed between the parser, the placer and the applier.

Everything here is a frozen dataclass so a parsed patch can be shared, cached and compared
without anyone mutating it behind the engine's back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

CONTEXT = " "
REMOVED = "-"
ADDED = "+"

OUTCOMES = ("exact", "offset", "fuzz", "failed")
ACTIONS = ("modify", "create", "delete", "rename")
STATUSES = ("applied", "already-applied", "failed")


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` block. ``lines`` are ``(kind, text)`` pairs; ``text`` has no '\\n' but keeps
    any '\\r', because a patch made on a CRLF file carries the '\\r' as content."""

    source_start: int
    source_length: int
    target_start: int
    target_length: int
    section: str
    lines: tuple[tuple[str, str], ...]
    old_no_newline: bool = False
    new_no_newline: bool = False

    @property
    def header(self) -> str:
        """The header as users see it in reports (counts always written out)."""
        return (
            f"@@ -{self.source_start},{self.source_length} "
            f"+{self.target_start},{self.target_length} @@"
        )

    @property
    def old_lines(self) -> tuple[str, ...]:
        """Texts the file must contain before the hunk applies (context and removed)."""
        return tuple(text for kind, text in self.lines if kind != ADDED)

    @property
    def new_lines(self) -> tuple[str, ...]:
        """Texts the file contains once the hunk applied (context and added)."""
        return tuple(text for kind, text in self.lines if kind != REMOVED)

    @property
    def leading_context(self) -> int:
        """Context lines before the first change: the only head lines fuzz may drop."""
        count = 0
        for kind, _ in self.lines:
            if kind != CONTEXT:
                break
            count += 1
        return count

    @property
    def trailing_context(self) -> int:
        """Context lines after the last change: the only tail lines fuzz may drop."""
        count = 0
        for kind, _ in reversed(self.lines):
            if kind != CONTEXT:
                break
            count += 1
        return count


@dataclass(frozen=True)
class FilePatch:
    """The diff of one file. Paths have their ``a/``/``b/`` prefix removed; ``None`` stands
    for ``/dev/null``. ``new_mode``/``old_mode`` are only set when the patch states a mode
    change or a created/deleted file's mode."""

    old_path: Optional[str]
    new_path: Optional[str]
    hunks: tuple[Hunk, ...]
    is_new: bool = False
    is_deleted: bool = False
    is_rename: bool = False
    old_blob: Optional[str] = None
    new_blob: Optional[str] = None
    new_mode: Optional[str] = None
    patch_line: int = 1
    old_mode: Optional[str] = None

    @property
    def path(self) -> str:
        """The path the file has once the patch is applied (or had, for a deletion)."""
        path = self.new_path or self.old_path
        assert path is not None, "a file patch always names at least one side"
        return path

    @property
    def action(self) -> str:
        """What the patch does to the file, in the words reports use."""
        if self.is_new:
            return "create"
        if self.is_deleted:
            return "delete"
        if self.is_rename:
            return "rename"
        return "modify"


@dataclass(frozen=True)
class Patch:
    """One patch file: the commit metadata (when it is a ``git format-patch`` mail) and its
    file diffs in patch order."""

    name: str
    subject: str
    message: str
    author: Optional[str]
    date: Optional[str]
    files: tuple[FilePatch, ...]


@dataclass(frozen=True)
class HunkResult:
    """Where one hunk landed (or the closest place found when it did not).

    ``line`` is 1-based in the file as it was before the patch; ``offset`` is that line minus
    the line the hunk header names. ``nearest_line``/``similarity`` are only set for failures.
    """

    file: str
    index: int
    header: str
    outcome: str
    offset: int
    fuzz: int
    line: Optional[int]
    nearest_line: Optional[int] = None
    similarity: Optional[float] = None

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "file": self.file,
            "index": self.index,
            "header": self.header,
            "outcome": self.outcome,
            "offset": self.offset,
            "fuzz": self.fuzz,
            "line": self.line,
        }
        if self.failed:
            data["nearest_line"] = self.nearest_line
            data["similarity"] = None if self.similarity is None else round(self.similarity, 3)
        return data


@dataclass(frozen=True)
class FileResult:
    """The outcome for one file; ``error`` is for file-level problems (missing file, file
    already exists, leftover content on delete) that no hunk result can express."""

    path: str
    old_path: Optional[str]
    action: str
    hunks: tuple[HunkResult, ...]
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and not any(h.failed for h in self.hunks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "old_path": self.old_path,
            "action": self.action,
            "error": self.error,
            "hunks": [hunk.to_dict() for hunk in self.hunks],
        }


@dataclass(frozen=True)
class PatchResult:
    """The outcome of one patch. ``changes`` is what the caller must write: path to full new
    bytes, or ``None`` to delete. It is empty unless the status is ``applied``."""

    name: str
    status: str
    files: tuple[FileResult, ...]
    changes: dict[str, Optional[bytes]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the tree holds the patch afterwards (applied now or before)."""
        return self.status != "failed"

    @property
    def hunks(self) -> tuple[HunkResult, ...]:
        return tuple(hunk for file in self.files for hunk in file.hunks)

    @property
    def failed_hunks(self) -> tuple[HunkResult, ...]:
        return tuple(hunk for hunk in self.hunks if hunk.failed)

    @property
    def file_errors(self) -> tuple[FileResult, ...]:
        return tuple(file for file in self.files if file.error is not None)

    @property
    def max_fuzz(self) -> int:
        return max((hunk.fuzz for hunk in self.hunks if not hunk.failed), default=0)

    @property
    def max_abs_offset(self) -> int:
        return max((abs(hunk.offset) for hunk in self.hunks if not hunk.failed), default=0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary; contents are left out, only which paths change and how."""
        return {
            "name": self.name,
            "status": self.status,
            "max_fuzz": self.max_fuzz,
            "max_abs_offset": self.max_abs_offset,
            "files": [file.to_dict() for file in self.files],
            "changes": {
                path: ("delete" if content is None else "write")
                for path, content in sorted(self.changes.items())
            },
        }
