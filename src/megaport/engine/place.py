"""Where does a hunk go? Exact position, then nearest offset, then fuzz, like GNU patch.

Lines are compared as full lines *with* their terminator ('\\n', or nothing for a last line
without newline), so a hunk that says "no newline at end of file" only matches a file that
really ends that way, and the reverse of such a hunk is not mistaken for the forward one.
The caller passes the file's lines and, when it compares ignoring CR, CR-free copies of both.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from .model import Hunk

_NEAREST_CANDIDATES = 6
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")
_COMMON_TOKEN_MIN = 20
_COMMON_TOKEN_SHARE = 50


@dataclass(frozen=True)
class Placement:
    """A found place: the (trimmed) old block starts at 0-based ``start``; ``trim_head`` and
    ``trim_tail`` context lines were dropped (``fuzz`` is the larger); ``offset`` is how far
    the untrimmed hunk moved from the expected index."""

    start: int
    fuzz: int
    offset: int
    trim_head: int
    trim_tail: int


def old_block(hunk: Hunk) -> list[str]:
    """The hunk's old side as file lines, terminators included."""
    texts = hunk.old_lines
    block = [text + "\n" for text in texts]
    if block and hunk.old_no_newline:
        block[-1] = texts[-1]
    return block


def expected_index(hunk: Hunk) -> int:
    """0-based index the header points at. ``-5,0`` means "after line 5", so an empty old
    side is inserted at index 5, while ``-5,3`` starts at index 4."""
    return hunk.source_start if hunk.source_length == 0 else max(hunk.source_start - 1, 0)


def locate(
    lines: Sequence[str],
    hunk: Hunk,
    expected: int,
    max_fuzz: int,
    search_from: int = 0,
    *,
    max_offset: Optional[int] = None,
) -> Optional[Placement]:
    """Find where ``hunk`` applies in ``lines``, not before ``search_from`` (hunks of one file
    land in order and never overlap). Fuzz level f may drop up to f leading and f trailing
    *context* lines, never changed lines; the lowest fuzz wins, then the smallest offset.
    ``max_offset=0`` asks for the expected position only."""
    block = old_block(hunk)
    lead, trail = _context_sizes(hunk, len(block))
    whole_file = _claims_empty_file(hunk)
    for fuzz in range(max_fuzz + 1):
        best: Optional[Placement] = None
        for head, tail in _trims(fuzz, lead, trail):
            if block and head + tail >= len(block):
                continue
            start = _search(
                lines,
                block[head : len(block) - tail],
                expected + head,
                search_from,
                max_offset,
                at_start=whole_file or (_starts_file(hunk) and head == 0),
                at_end=whole_file or trail == 0 or (tail == 0 and _ends_without_newline(hunk)),
            )
            if start is None:
                continue
            found = Placement(start, fuzz, start - head - expected, head, tail)
            if best is None or _rank(found) < _rank(best):
                best = found
        if best is not None:
            return best
    return None


def nearest(
    lines: Sequence[str],
    hunk: Hunk,
    expected: Optional[int] = None,
    *,
    index: Optional["TokenIndex"] = None,
) -> tuple[int, float]:
    """The 1-based line where the file looks most like the hunk's old side, and how much
    (difflib ratio, 0..1). Windows are first ranked by shared identifiers (cheap, and robust
    to renamed variables and re-indentation), then the best few are scored character by
    character. Pass ``index`` when asking about several hunks of one file."""
    block = old_block(hunk)
    size = len(block)
    last_start = max(len(lines) - size, 0)
    anchor = min(max(expected if expected is not None else 0, 0), last_start)
    if not block or not lines:
        return anchor + 1, 0.0
    votes = (index or TokenIndex(lines)).votes(block, last_start)
    ranked = sorted(votes.items(), key=lambda item: (-item[1], abs(item[0] - anchor)))
    starts = [start for start, _ in ranked[:_NEAREST_CANDIDATES]]
    if anchor not in starts:
        starts.append(anchor)
    wanted = "".join(block)
    scored = [
        (_similarity(wanted, "".join(lines[start : start + size])), -abs(start - anchor), start)
        for start in starts
    ]
    ratio, _, start = max(scored)
    return start + 1, ratio


class TokenIndex:
    """Identifiers of each file line, built once per file, to vote for candidate windows.
    Identifiers found on many lines (``self``, ``return``) are ignored: they point nowhere."""

    def __init__(self, lines: Sequence[str]) -> None:
        self._tokens = [frozenset(_TOKEN.findall(line)) for line in lines]
        counts = Counter(token for tokens in self._tokens for token in tokens)
        limit = max(_COMMON_TOKEN_MIN, len(self._tokens) // _COMMON_TOKEN_SHARE)
        self._common = {token for token, count in counts.items() if count > limit}

    def votes(self, block: Sequence[str], last_start: int) -> dict[int, float]:
        """Window start -> score; a file line sharing all rare identifiers of hunk line j
        gives about one vote to the window starting j lines earlier."""
        weights: dict[str, list[tuple[int, float]]] = {}
        for j, line in enumerate(block):
            hunk_tokens = set(_TOKEN.findall(line))
            for token in hunk_tokens - self._common:
                weights.setdefault(token, []).append((j, 1.0 / len(hunk_tokens)))
        wanted = set(weights)
        votes: dict[int, float] = {}
        for i, line_tokens in enumerate(self._tokens):
            for token in line_tokens & wanted:
                for j, weight in weights[token]:
                    start = min(max(i - j, 0), last_start)
                    votes[start] = votes.get(start, 0.0) + weight
        return votes


def _context_sizes(hunk: Hunk, block_size: int) -> tuple[int, int]:
    """Leading/trailing context; a hunk of context only has no "changed middle", so its
    context counts as leading and trailing at once, capped by the block size."""
    return min(hunk.leading_context, block_size), min(hunk.trailing_context, block_size)


def _starts_file(hunk: Hunk) -> bool:
    """git apply's rule (what ``git am`` does with our series): a hunk whose old side starts
    at line 1 is anchored to the start of the file. Unlike GNU patch, uneven leading and
    trailing context is not taken as a file boundary, because series may trim context
    asymmetrically where upstream releases differ. Likewise only a hunk with no trailing
    context at all is anchored to the end."""
    return hunk.source_start <= 1


def _claims_empty_file(hunk: Hunk) -> bool:
    """``@@ -0,0 ...`` says "the old file had no lines" (as git apply reads it, unless a
    patch was made with -U0): such a hunk must not be inserted into a non-empty file."""
    return hunk.source_start == 0 and hunk.source_length == 0


def _ends_without_newline(hunk: Hunk) -> bool:
    """A hunk whose last line has no newline can only sit at the very end of the file;
    elsewhere it would glue its last line to the next one."""
    return hunk.old_no_newline or hunk.new_no_newline


def _trims(fuzz: int, lead: int, trail: int) -> list[tuple[int, int]]:
    """(head, tail) context lines to drop at this fuzz level, least dropped first."""
    pairs = [
        (head, tail)
        for head in range(min(fuzz, lead) + 1)
        for tail in range(min(fuzz, trail) + 1)
        if max(head, tail) == fuzz
    ]
    return sorted(pairs, key=lambda pair: (pair[0] + pair[1], pair))


def _rank(placement: Placement) -> tuple[int, int, bool]:
    """Smaller offset first, then less context dropped; on equal distance the later
    position wins, as in GNU patch."""
    return (
        abs(placement.offset),
        placement.trim_head + placement.trim_tail,
        placement.offset < 0,
    )


def _search(
    lines: Sequence[str],
    pattern: list[str],
    expected: int,
    search_from: int,
    max_offset: Optional[int],
    *,
    at_start: bool,
    at_end: bool,
) -> Optional[int]:
    """Nearest index >= ``search_from`` where ``pattern`` occurs; ``at_start``/``at_end``
    pin it to the start/end of the file (both: the pattern must be the whole file)."""
    size = len(lines)
    if not pattern:
        return _insertion_point(
            lines, expected, search_from, max_offset, at_start=at_start, at_end=at_end
        )
    last = size - len(pattern)
    if at_start and at_end:
        candidates = [0] if last == 0 else []
    elif at_start:
        candidates = [0]
    elif at_end:
        candidates = [last]
    else:
        first = pattern[0]
        candidates = [i for i in range(max(search_from, 0), last + 1) if lines[i] == first]
        candidates.sort(key=lambda i: (abs(i - expected), i < expected))
    for start in candidates:
        if start < search_from or start > last:
            continue
        if max_offset is not None and abs(start - expected) > max_offset:
            if at_start or at_end:
                continue
            break
        if list(lines[start : start + len(pattern)]) == pattern:
            return start
    return None


def _insertion_point(
    lines: Sequence[str],
    expected: int,
    search_from: int,
    max_offset: Optional[int],
    *,
    at_start: bool,
    at_end: bool,
) -> Optional[int]:
    """Where a hunk without old lines goes: the expected index (or the end of the file for
    ``at_end``), kept inside the file and after earlier hunks; never after a last line that
    has no newline (the inserted text would be glued to it)."""
    if at_start and at_end and lines:
        return None
    point = len(lines) if at_end else min(max(expected, search_from), len(lines))
    if point < search_from:
        return None
    if max_offset is not None and abs(point - expected) > max_offset:
        return None
    if point == len(lines) and lines and not lines[-1].endswith("\n"):
        return None
    return point


def _similarity(wanted: str, found: str) -> float:
    return difflib.SequenceMatcher(None, wanted, found, autojunk=False).ratio()
