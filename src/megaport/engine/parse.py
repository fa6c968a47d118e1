"""Patch text -> :class:`Patch`.

The mail header of ``git format-patch`` output and git's extended headers (``new file mode``,
``rename from``, ``index``...) are read here, line by line, because they are simple and their
meaning matters to the applier; hunk bodies are parsed by ``unidiff``, which checks the line
counts. The text is split on '\\n' only so a '\\r' that belongs to a CRLF file's line stays in
the hunk line, and every error names the patch and a line number in one line of text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.header import decode_header, make_header
from typing import Optional

import unidiff
from unidiff.errors import UnidiffParseError

from .errors import PatchFormatError
from .gitquote import unquote_path
from .model import ADDED, CONTEXT, REMOVED, FilePatch, Hunk, Patch
from .text import split_lines, strip_newline

DEV_NULL = "/dev/null"
_GIT_HEADER = "diff --git "
_MBOX_FROM = re.compile(r"^From [0-9a-f]{7,64} ")
_MAIL_HEADER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*:")
_PATCH_TAG = re.compile(r"^\s*(\[[^\]]*PATCH[^\]]*\]\s*)+", re.IGNORECASE)
_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: ([0-7]+))?$")
_MODE_LINES = {
    "new file mode ": "new_mode",
    "new mode ": "new_mode",
    "deleted file mode ": "old_mode",
    "old mode ": "old_mode",
}
# What `git format-patch --base` writes after the last hunk, before the signature.
_GIT_TRAILERS = ("base-commit: ", "prerequisite-patch-id: ")
_UNIDIFF_MESSAGES = {
    "Hunk is shorter than expected": "hunk has fewer lines than its header says (truncated?)",
    "Hunk is longer than expected": "hunk has more lines than its header says",
}


@dataclass(frozen=True)
class _Mail:
    subject: str
    message: str
    author: Optional[str]
    date: Optional[str]


def parse_patch(text: str, name: str = "") -> Patch:
    """Parse one patch (``git format-patch`` mail, ``git diff`` or plain ``diff -u``)."""
    label = name or "<patch>"
    lines = split_lines(text)
    diff_start = _find_diff_start(lines)
    if diff_start is None:
        raise PatchFormatError(f"{label}: not a unified diff: no file header found")
    _refuse_second_mail(lines, diff_start, label)
    mail = _read_mail(lines[:diff_start])
    if any(line.startswith(_GIT_HEADER) for line in lines[diff_start:]):
        files = _parse_git_diff(lines, diff_start, label)
    else:
        files = _parse_plain_diff(lines, diff_start, label)
    if not files:
        raise PatchFormatError(f"{label}: not a unified diff: no file header found")
    return Patch(
        name=name,
        subject=mail.subject,
        message=mail.message,
        author=mail.author,
        date=mail.date,
        files=tuple(files),
    )


# --- mail header ------------------------------------------------------------------------


def _find_diff_start(lines: list[str]) -> Optional[int]:
    """Index of the first ``diff --git`` line or ``---``/``+++`` pair, i.e. the end of the
    commit message and diffstat."""
    for index, line in enumerate(lines):
        if line.startswith(_GIT_HEADER):
            return index
        if (
            line.startswith("--- ")
            and index + 1 < len(lines)
            and lines[index + 1].startswith("+++ ")
        ):
            return index
    return None


def _refuse_second_mail(lines: list[str], diff_start: int, label: str) -> None:
    """``git format-patch --stdout`` concatenates mails; their diffs would silently merge
    into one patch, so insist on one patch per file."""
    for index in range(diff_start, len(lines)):
        if _MBOX_FROM.match(lines[index]):
            raise PatchFormatError(
                f"{label}: a second patch starts at line {index + 1}; "
                "give each patch its own file (git format-patch without --stdout)"
            )


def _read_mail(preamble: list[str]) -> _Mail:
    """Subject/author/date/message from a format-patch mail; for other patches the free text
    before the diff (if any) becomes the message and its first line the subject."""
    start = 1 if preamble and _MBOX_FROM.match(preamble[0]) else 0
    header_end = _mail_header_end(preamble, start)
    if header_end is None:
        message = "".join(preamble).strip()
        return _Mail(subject=message.split("\n", 1)[0].strip(), message=message, author=None, date=None)
    headers = _mail_headers([_no_cr(line) for line in preamble[start:header_end]])
    body = []
    for line in preamble[header_end + 1 :]:
        if _no_cr(line).rstrip("\n") == "---":
            break
        body.append(_no_cr(line))
    subject = _PATCH_TAG.sub("", _header_text(headers.get("subject")) or "").strip()
    return _Mail(
        subject=subject,
        message="".join(body).strip(),
        author=_header_text(headers.get("from")),
        date=_header_text(headers.get("date")),
    )


def _mail_header_end(preamble: list[str], start: int) -> Optional[int]:
    """Index of the blank line ending an RFC 822 header block at ``start``, if there is one
    naming a Subject or From (otherwise the preamble is not a mail)."""
    names: set[str] = set()
    for index in range(start, len(preamble)):
        line = _no_cr(preamble[index])
        if line.strip() == "":
            return index if names & {"subject", "from"} else None
        if line[0] in " \t" and names:
            continue
        if not _MAIL_HEADER.match(line):
            return None
        names.add(line.split(":", 1)[0].lower())
    return None


def _mail_headers(lines: list[str]) -> dict[str, str]:
    """Lower-cased name -> value of the header block :func:`_mail_header_end` found: the first
    of each name, continuation lines kept, as ``email.parser`` (compat32) gives it; that parser
    and the ``email.policy`` it needs cost every apply's start-up ~10 ms of imports."""
    raw: dict[str, list[str]] = {}
    current: Optional[list[str]] = None  # the lines of a first occurrence being read
    for line in lines:
        if line[:1] in (" ", "\t"):
            if current is not None:
                current.append(line)
            continue
        key, _, value = line.partition(":")
        name = key.strip().lower()
        current = None if name in raw else raw.setdefault(name, [value.lstrip(" \t")])
    return {name: "".join(parts).rstrip("\r\n") for name, parts in raw.items()}


def _header_text(value: Optional[str]) -> Optional[str]:
    """Unfold and decode an RFC 2047 header (format-patch encodes non-ASCII names)."""
    if value is None:
        return None
    unfolded = re.sub(r"\r?\n[ \t]+", " ", str(value)).strip()
    try:
        return str(make_header(decode_header(unfolded)))
    except (UnicodeError, LookupError, ValueError):
        return unfolded


def _no_cr(line: str) -> str:
    """Header lines never legitimately end in '\\r'; a CRLF-mangled patch file has them."""
    return line[:-2] + "\n" if line.endswith("\r\n") else line


# --- git diffs --------------------------------------------------------------------------


def _parse_git_diff(lines: list[str], start: int, label: str) -> list[FilePatch]:
    """Split at ``diff --git`` lines (which cannot occur inside a hunk) and parse each file."""
    starts = [i for i in range(start, len(lines)) if lines[i].startswith(_GIT_HEADER)]
    if starts[0] != start:
        raise PatchFormatError(
            f"{label}: file header without 'diff --git' line (line {start + 1})"
        )
    bounds = list(zip(starts, starts[1:] + [len(lines)]))
    return [
        _parse_git_file(lines, begin, end, label, is_last=(end == len(lines)))
        for begin, end in bounds
    ]


def _parse_git_file(
    lines: list[str], begin: int, end: int, label: str, *, is_last: bool
) -> FilePatch:
    """One ``diff --git`` section: extended headers, then ``---``/``+++`` and hunks."""
    header, body_start = _read_git_header(lines, begin, end, label)
    git_old, git_new = _paths_from_git_line(strip_newline(_no_cr(lines[begin])))
    old_path = header.get("rename_from") or git_old
    new_path = header.get("rename_to") or git_new
    hunks: tuple[Hunk, ...] = ()
    if body_start < end:
        where = f"in the diff of '{new_path or old_path}' (line {begin + 1})"
        old_path, new_path, hunks = _parse_git_body(
            lines, body_start, end, label, where, is_last=is_last
        )
    is_new = "new_file" in header or old_path is None
    is_deleted = "deleted_file" in header or new_path is None
    if is_new:
        old_path = None
    if is_deleted:
        new_path = None
    if old_path is None and new_path is None:
        raise PatchFormatError(f"{label}: cannot tell which file line {begin + 1} changes")
    return FilePatch(
        old_path=old_path,
        new_path=new_path,
        hunks=hunks,
        is_new=is_new,
        is_deleted=is_deleted,
        is_rename="rename_from" in header and not is_new and not is_deleted,
        old_blob=header.get("old_blob"),
        new_blob=header.get("new_blob"),
        new_mode=header.get("new_mode"),
        old_mode=header.get("old_mode"),
        patch_line=begin + 1,
    )


def _read_git_header(
    lines: list[str], begin: int, end: int, label: str
) -> tuple[dict[str, str], int]:
    """The extended header lines after ``diff --git``, and where ``---`` starts (``end`` for
    a file without hunks: pure rename, mode change, empty new file)."""
    header: dict[str, str] = {}
    for index in range(begin + 1, end):
        line = strip_newline(_no_cr(lines[index]))
        if line.startswith("@@"):
            raise PatchFormatError(
                f"{label}: hunk without '---'/'+++' file header (line {index + 1})"
            )
        if line.startswith("--- "):
            return header, index
        _read_extended_header(line, header, label, index)
    return header, end


def _parse_git_body(
    lines: list[str], begin: int, end: int, label: str, where: str, *, is_last: bool
) -> tuple[Optional[str], Optional[str], tuple[Hunk, ...]]:
    """``---``/``+++`` names and the hunks of one git file section."""
    parsed = _unidiff_files(lines, begin, end, label, where)
    if len(parsed) != 1:
        raise PatchFormatError(f"{label}: expected one file {where}, found {len(parsed)}")
    raw, hunks, consumed = parsed[0]
    _check_no_stray_lines(lines, begin, end, consumed, label, is_last=is_last, strict=True)
    return _path_or_none(raw.source_file, "a/"), _path_or_none(raw.target_file, "b/"), hunks


def _read_extended_header(line: str, header: dict[str, str], label: str, index: int) -> None:
    """Record one git extended header line; refuse what the engine cannot apply."""
    for prefix, key in _MODE_LINES.items():
        if line.startswith(prefix):
            header[key] = line[len(prefix) :].strip()
            if prefix == "new file mode ":
                header["new_file"] = "1"
            if prefix == "deleted file mode ":
                header["deleted_file"] = "1"
            return
    if line.startswith("rename from "):
        header["rename_from"] = unquote_path(line[len("rename from ") :])
    elif line.startswith("rename to "):
        header["rename_to"] = unquote_path(line[len("rename to ") :])
    elif line.startswith(("copy from ", "copy to ")):
        raise PatchFormatError(
            f"{label}: copy diffs are not supported (line {index + 1}); "
            "regenerate the patch without -C"
        )
    elif line.startswith("Binary files ") or line == "GIT binary patch":
        raise PatchFormatError(
            f"{label}: binary diff at line {index + 1} cannot be applied; "
            "ship binary files outside the patch series"
        )
    else:
        match = _INDEX.match(line)
        if match:
            header["old_blob"], header["new_blob"] = match.group(1), match.group(2)


def _paths_from_git_line(line: str) -> tuple[Optional[str], Optional[str]]:
    """Paths from ``diff --git a/X b/Y``; only used when no ``---``/``rename`` line says
    better (hunkless files). Unquoted names with spaces are split where both halves agree."""
    rest = line[len(_GIT_HEADER) :]
    if rest.startswith('"'):
        match = re.match(r'^("(?:[^"\\]|\\.)*")\s+(.*)$', rest)
        if not match:
            return None, None
        return _strip_prefix(unquote_path(match.group(1)), "a/"), _strip_prefix(
            unquote_path(match.group(2)), "b/"
        )
    if rest.endswith('"'):
        match = re.match(r'^(.*?)\s+("(?:[^"\\]|\\.)*")$', rest)
        if match:
            return _strip_prefix(match.group(1), "a/"), _strip_prefix(
                unquote_path(match.group(2)), "b/"
            )
    if rest.startswith("a/") and len(rest) % 2 == 1:
        half = (len(rest) - 1) // 2
        old, new = rest[:half], rest[half + 1 :]
        if new.startswith("b/") and old[2:] == new[2:]:
            return old[2:], new[2:]
    old, _, new = rest.partition(" b/")
    return _strip_prefix(old, "a/"), new or None


def _strip_prefix(path: str, prefix: str) -> str:
    return path[len(prefix) :] if path.startswith(prefix) else path


def _path_or_none(raw: str, prefix: str) -> Optional[str]:
    """A ``---``/``+++`` name as a repository path: unquoted, prefix dropped, ``/dev/null``
    as None."""
    path = unquote_path(raw.rstrip("\r").strip())
    if path == DEV_NULL:
        return None
    return _strip_prefix(path, prefix)


# --- plain diffs --------------------------------------------------------------------------


def _parse_plain_diff(lines: list[str], start: int, label: str) -> list[FilePatch]:
    """A non-git diff: no extended headers, so unidiff reads it all at once."""
    parsed = _unidiff_files(lines, start, len(lines), label, f"in the diff at line {start + 1}")
    consumed = set().union(*(used for _, _, used in parsed)) if parsed else set()
    _check_no_stray_lines(lines, start, len(lines), consumed, label, is_last=True, strict=False)
    files = []
    for raw, hunks, used in parsed:
        old_path = _path_or_none(raw.source_file, "a/")
        new_path = _path_or_none(raw.target_file, "b/")
        first_line = min(used) if used else start
        files.append(
            FilePatch(
                old_path=old_path,
                new_path=new_path,
                hunks=hunks,
                is_new=old_path is None,
                is_deleted=new_path is None,
                is_rename=False,
                patch_line=max(start, first_line - 3) + 1,
            )
        )
    return files


# --- hunks through unidiff ------------------------------------------------------------------


def _unidiff_files(
    lines: list[str], begin: int, end: int, label: str, where: str
) -> list[tuple[unidiff.PatchedFile, tuple[Hunk, ...], set[int]]]:
    """Run unidiff on ``lines[begin:end]``; returns each file with its converted hunks and
    the 0-based patch line numbers its hunk lines occupy."""
    try:
        patch_set = unidiff.PatchSet(lines[begin:end])
    except UnidiffParseError as error:
        raise PatchFormatError(f"{label}: {_describe_unidiff_error(error)} {where}") from None
    except UnicodeError as error:
        raise PatchFormatError(f"{label}: cannot read patch text: {error}") from None
    result = []
    for patched in patch_set:
        if patched.is_binary_file:
            raise PatchFormatError(f"{label}: binary diff for '{patched.path}' cannot be applied")
        path = _path_or_none(patched.target_file, "b/") or _path_or_none(patched.source_file, "a/")
        hunks = []
        consumed: set[int] = set()
        for number, raw_hunk in enumerate(patched, 1):
            hunks.append(_convert_hunk(raw_hunk, label, f"hunk {number} of '{path}'"))
            consumed.update(
                begin + line.diff_line_no - 1 for line in raw_hunk if line.diff_line_no
            )
        result.append((patched, tuple(hunks), consumed))
    return result


def _describe_unidiff_error(error: UnidiffParseError) -> str:
    text = str(error).strip()
    for known, friendly in _UNIDIFF_MESSAGES.items():
        if text.startswith(known):
            return friendly
    prefix = "Hunk diff line expected: "
    if text.startswith(prefix):
        line = text[len(prefix) :].rstrip("\r\n")
        return f"unexpected line {_shorten(line)!r} inside a hunk"
    return "malformed diff: " + _shorten(text.split("\n", 1)[0])


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _convert_hunk(raw: unidiff.Hunk, label: str, where: str) -> Hunk:
    """unidiff's hunk -> ours: line texts without '\\n', and the two no-newline flags."""
    lines: list[tuple[str, str]] = []
    old_flag: Optional[int] = None
    new_flag: Optional[int] = None
    for line in raw:
        kind = line.line_type
        if kind in (CONTEXT, ADDED, REMOVED):
            lines.append((kind, strip_newline(line.value)))
        elif kind == "\\":
            if not lines:
                raise PatchFormatError(f"{label}: '\\ No newline' marker opens {where}")
            previous = lines[-1][0]
            if previous != ADDED:
                old_flag = len(lines) - 1
            if previous != REMOVED:
                new_flag = len(lines) - 1
    _check_no_newline_flag(lines, old_flag, ADDED, label, where)
    _check_no_newline_flag(lines, new_flag, REMOVED, label, where)
    return Hunk(
        source_start=raw.source_start,
        source_length=raw.source_length,
        target_start=raw.target_start,
        target_length=raw.target_length,
        section=raw.section_header.strip(),
        lines=tuple(lines),
        old_no_newline=old_flag is not None,
        new_no_newline=new_flag is not None,
    )


def _check_no_newline_flag(
    lines: list[tuple[str, str]], flagged: Optional[int], other_side: str, label: str, where: str
) -> None:
    """A "no newline" marker must follow the last line of its side of the hunk."""
    if flagged is None:
        return
    if any(kind != other_side for kind, _ in lines[flagged + 1 :]):
        raise PatchFormatError(
            f"{label}: '\\ No newline at end of file' in the middle of {where}"
        )


def _check_no_stray_lines(
    lines: list[str],
    begin: int,
    end: int,
    consumed: set[int],
    label: str,
    *,
    is_last: bool,
    strict: bool,
) -> None:
    """Catch hunks whose header counts are too small: unidiff would silently drop the extra
    lines. Allowed outside hunks: headers, markers, blank lines and, at the end of the patch,
    the ``-- `` signature; ``strict`` (git diffs) also refuses any other free text."""
    for index in range(begin, end):
        if index in consumed:
            continue
        line = _no_cr(lines[index])
        if is_last and line in ("-- \n", "--\n", "-- "):
            return
        if line.strip() == "" or line.startswith(("@@", "\\", "--- ", "+++ ")):
            continue
        if is_last and line.startswith(_GIT_TRAILERS):
            continue
        if strict or line[0] in (CONTEXT, ADDED, REMOVED):
            raise PatchFormatError(
                f"{label}: line {index + 1} is outside any hunk "
                "(hunk has more lines than its header says?)"
            )
