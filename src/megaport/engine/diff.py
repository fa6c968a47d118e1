"""Contents -> git-style unified diff of one file, for the series generator and the tests.

Lines keep their endings through difflib, so CRLF lines produce '\\r' in the patch and a
missing final newline produces git's "\\ No newline at end of file" marker. The ``index``
line carries full blob ids, which lets the applier recognise already-applied patches.
"""

from __future__ import annotations

import difflib
import re
from typing import Optional

from .blob import git_blob_id
from .gitquote import quote_path
from .text import decode, split_lines

NULL_BLOB = "0" * 40
NO_NEWLINE_MARKER = "\\ No newline at end of file\n"
DEFAULT_MODE = "100644"


def make_file_diff(
    path: str, old: Optional[bytes], new: Optional[bytes], context: int = 3
) -> str:
    """Diff of ``path`` from ``old`` to ``new`` (None: the file does not exist on that side).
    Returns "" when nothing changes."""
    if old is None and new is None:
        raise ValueError(f"{path}: a diff needs at least one side")
    if old == new:
        return ""
    old_lines = split_lines(decode(old or b""))
    new_lines = split_lines(decode(new or b""))
    out = _file_header(path, old, new)
    if old_lines or new_lines:
        out.append(_name_line("---", "a/", path, old is None))
        out.append(_name_line("+++", "b/", path, new is None))
        out.extend(_hunks(old_lines, new_lines, context))
    return "".join(out)


def _file_header(path: str, old: Optional[bytes], new: Optional[bytes]) -> list[str]:
    """``diff --git``, the create/delete mode line and the ``index`` line."""
    name_a, name_b = quote_path("a/" + path), quote_path("b/" + path)
    header = [f"diff --git {name_a} {name_b}\n"]
    old_id = NULL_BLOB if old is None else git_blob_id(old)
    new_id = NULL_BLOB if new is None else git_blob_id(new)
    if old is None:
        header.append(f"new file mode {DEFAULT_MODE}\n")
        header.append(f"index {old_id}..{new_id}\n")
    elif new is None:
        header.append(f"deleted file mode {DEFAULT_MODE}\n")
        header.append(f"index {old_id}..{new_id}\n")
    else:
        header.append(f"index {old_id}..{new_id} {DEFAULT_MODE}\n")
    return header


def _name_line(marker: str, prefix: str, path: str, missing: bool) -> str:
    """``--- a/p`` / ``+++ b/p``; git adds a tab after names with spaces so tools that
    read ``name<TAB>timestamp`` find the whole name."""
    if missing:
        return f"{marker} /dev/null\n"
    name = quote_path(prefix + path)
    return f"{marker} {name}{chr(9) if ' ' in name else ''}\n"


def _hunks(old_lines: list[str], new_lines: list[str], context: int) -> list[str]:
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    out: list[str] = []
    for group in matcher.get_grouped_opcodes(context):
        first, last = group[0], group[-1]
        out.append(
            f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@\n"
        )
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend(_body_line(" ", line) for line in old_lines[i1:i2])
                continue
            out.extend(_body_line("-", line) for line in old_lines[i1:i2])
            out.extend(_body_line("+", line) for line in new_lines[j1:j2])
    return out


def _range(start: int, stop: int) -> str:
    """Unified-diff range: ``5`` for one line, ``5,3``, and ``4,0`` for "after line 4"."""
    length = stop - start
    if length == 1:
        return f"{start + 1}"
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def _body_line(kind: str, line: str) -> str:
    if line.endswith("\n"):
        return kind + line
    return kind + line + "\n" + NO_NEWLINE_MARKER


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@$", re.MULTILINE)
_FUNCNAME_LIMIT = 80


def with_function_names(diff: str, old: Optional[bytes]) -> str:
    """Add the text git puts after ``@@ ... @@`` (the nearest line above the hunk that starts
    with a letter, ``_`` or ``$``, at most 80 bytes), so regenerated hunks read like git's."""
    if old is None:
        return diff
    lines = old.decode("utf-8", "surrogateescape").split("\n")

    def name(match: re.Match) -> str:
        start = int(match.group(1)) - (0 if match.group(2) == "0" else 1)
        for index in range(min(start, len(lines)) - 1, -1, -1):
            line = lines[index]
            if line[:1].isalpha() or line[:1] in ("_", "$"):
                text = line.encode("utf-8", "surrogateescape")[:_FUNCNAME_LIMIT].decode("utf-8", "ignore").rstrip()
                return f"{match.group(0)} {text}"
        return match.group(0)

    return _HUNK_HEADER.sub(name, diff)
