"""Lossless bytes <-> text and line splitting shared by the parser, applier and differ.

Files are decoded as UTF-8 with ``surrogateescape`` so any byte sequence survives a round
trip, and lines are split on '\\n' only: '\\r' stays part of the line so CRLF files keep their
endings, and ``str.splitlines`` is avoided because it also splits on '\\r', '\\x0c', U+2028...
"""

from __future__ import annotations

ENCODING = "utf-8"
ERRORS = "surrogateescape"


def decode(data: bytes) -> str:
    """Bytes to text without ever failing, so binary-ish or Latin-1 files still round-trip."""
    return data.decode(ENCODING, ERRORS)


def encode(text: str) -> bytes:
    """Inverse of :func:`decode` (escaped bytes come back unchanged)."""
    return text.encode(ENCODING, ERRORS)


def split_lines(text: str) -> list[str]:
    """Lines with their '\\n' kept; only the last one may lack it (no final newline)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def strip_newline(line: str) -> str:
    """Drop one terminating '\\n', keeping any '\\r' before it."""
    return line[:-1] if line.endswith("\n") else line


def uses_crlf(lines: list[str]) -> bool:
    """True when most terminated lines end in CRLF: new lines then get CRLF too."""
    crlf = sum(1 for line in lines if line.endswith("\r\n"))
    lf = sum(1 for line in lines if line.endswith("\n")) - crlf
    return crlf > lf


def without_cr(line: str) -> str:
    """A line with a CRLF (or a lone final '\\r') turned into LF, for ending-blind compares."""
    if line.endswith("\r\n"):
        return line[:-2] + "\n"
    if line.endswith("\r"):
        return line[:-1]
    return line
