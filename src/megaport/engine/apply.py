"""Apply a parsed patch to file contents supplied by the caller; nothing touches the disk.

``read(path)`` returns a file's current bytes or None, so the same code serves a git tree,
a dict in tests, or a working directory. The result lists every hunk (not just the first
failure) and, on success, the full new bytes of each changed file.

Order of attempts, so an already-applied patch is not applied twice:
1. forward, every hunk at its exact line (skipped when the files' blob ids show the patch's
   result is already there);
2. reverse, exact: the tree already holds the patch;
3. forward with offsets and up to ``max_fuzz``;
4. reverse with offsets.
Repetitive code can make a forward hunk match the patched text too; trying the exact reverse
before shifted forward placements (and trusting ``index`` lines) avoids applying it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

from .blob import blob_matches
from .model import (
    ADDED,
    CONTEXT,
    REMOVED,
    FilePatch,
    FileResult,
    Hunk,
    HunkResult,
    Patch,
    PatchResult,
)
from .place import Placement, TokenIndex, expected_index, locate, nearest
from .text import decode, encode, split_lines, uses_crlf, without_cr

Reader = Callable[[str], Optional[bytes]]
Changes = dict[str, Optional[bytes]]

_SWAP = {ADDED: REMOVED, REMOVED: ADDED, CONTEXT: CONTEXT}


@dataclass(frozen=True)
class _Limits:
    """How hard one pass may look. Only the pass whose failure is reported (``report``)
    tries every hunk and looks for the nearest match; the others stop at the first miss."""

    max_fuzz: int
    max_offset: Optional[int]
    report: bool = False
    find_nearest: bool = True


_EXACT = _Limits(max_fuzz=0, max_offset=0)


@dataclass(frozen=True)
class _Attempt:
    """One pass over all files of a patch with given placement limits."""

    files: tuple[FileResult, ...]
    changes: Changes

    @property
    def ok(self) -> bool:
        return all(file.ok for file in self.files)


def apply_patch(patch: Patch, read: Reader, *, max_fuzz: int = 0, find_nearest: bool = True) -> PatchResult:
    """Apply ``patch`` to the files ``read`` returns. Status is "applied" (``changes`` holds
    the new contents), "already-applied" (the reverse patch fits the current files) or
    "failed" (every hunk's outcome is reported, ``changes`` is empty). ``find_nearest=False`` skips
    the search for where a failed hunk comes closest (drift's fit of series nobody sees)."""
    if max_fuzz < 0:
        raise ValueError("max_fuzz must be >= 0")
    reverse = reverse_patch(patch)
    if not _holds_result(patch, read):
        exact = _attempt(patch, read, _EXACT)
        if exact.ok:
            return PatchResult(patch.name, "applied", exact.files, exact.changes)
    undone = _attempt(reverse, read, _EXACT)
    if undone.ok:
        return _already_applied(patch, undone)
    forward = _attempt(patch, read, _Limits(max_fuzz=max_fuzz, max_offset=None, report=True, find_nearest=find_nearest))
    if forward.ok:
        return PatchResult(patch.name, "applied", forward.files, forward.changes)
    undone = _attempt(reverse, read, _Limits(max_fuzz=0, max_offset=None))
    if undone.ok:
        return _already_applied(patch, undone)
    return PatchResult(patch.name, "failed", forward.files, {})


def apply_series(
    patches: Iterable[Patch], read: Reader, *, max_fuzz: int = 0
) -> list[PatchResult]:
    """Apply patches in order, each one seeing what the earlier ones wrote; stop after the
    first failure (later patches get no result, their base would be wrong anyway)."""
    written: Changes = {}

    def current(path: str) -> Optional[bytes]:
        return written[path] if path in written else read(path)

    results = []
    for patch in patches:
        result = apply_patch(patch, current, max_fuzz=max_fuzz)
        results.append(result)
        if result.status == "failed":
            break
        written.update(result.changes)
    return results


def reverse_patch(patch: Patch) -> Patch:
    """The patch that undoes ``patch``: sides swapped, files in reverse order."""
    return replace(patch, files=tuple(_reverse_file(file) for file in reversed(patch.files)))


def _reverse_file(file: FilePatch) -> FilePatch:
    return replace(
        file,
        old_path=file.new_path,
        new_path=file.old_path,
        hunks=tuple(_reverse_hunk(hunk) for hunk in file.hunks),
        is_new=file.is_deleted,
        is_deleted=file.is_new,
        old_blob=file.new_blob,
        new_blob=file.old_blob,
        new_mode=file.old_mode,
        old_mode=file.new_mode,
    )


def _reverse_hunk(hunk: Hunk) -> Hunk:
    return Hunk(
        source_start=hunk.target_start,
        source_length=hunk.target_length,
        target_start=hunk.source_start,
        target_length=hunk.source_length,
        section=hunk.section,
        lines=tuple((_SWAP[kind], text) for kind, text in hunk.lines),
        old_no_newline=hunk.new_no_newline,
        new_no_newline=hunk.old_no_newline,
    )


# --- one pass over the files of a patch ---------------------------------------------------


def _attempt(patch: Patch, read: Reader, limits: _Limits) -> _Attempt:
    """Apply every file; later files of the same patch see earlier ones' results."""
    written: Changes = {}

    def current(path: str) -> Optional[bytes]:
        return written[path] if path in written else read(path)

    results = []
    for file in patch.files:
        result, writes = _apply_file(file, current, limits)
        results.append(result)
        written.update(writes)
        if not result.ok and not limits.report:
            break
    attempt = _Attempt(tuple(results), written)
    return attempt if attempt.ok else _Attempt(attempt.files, {})


def _apply_file(
    file: FilePatch, current: Reader, limits: _Limits
) -> tuple[FileResult, Changes]:
    """Create, delete, rename or modify one file; returns its result and what to write."""
    source_path = _source_path(file)
    problem = _precondition_problem(file, current)
    if problem is not None:
        return _file_failure(file, problem), {}
    source = b"" if file.is_new else current(source_path)
    assert source is not None
    text, hunks = patch_text(
        decode(source),
        file.hunks,
        path=file.path,
        max_fuzz=limits.max_fuzz,
        max_offset=limits.max_offset,
        report=limits.report,
        find_nearest=limits.find_nearest,
    )
    result = FileResult(file.path, _old_path_for_report(file), file.action, hunks)
    if text is None:
        if file.is_deleted:
            result = replace(result, error="file content differs from what the patch deletes")
        return result, {}
    if file.is_deleted:
        if text:
            leftover = len(split_lines(text))
            return replace(
                result,
                error=f"{leftover} line(s) would remain that the patch does not delete",
            ), {}
        return result, {source_path: None}
    writes: Changes = {file.path: encode(text)}
    if file.is_rename and source_path != file.path:
        writes[source_path] = None
    return result, writes


def _source_path(file: FilePatch) -> str:
    """The path whose current content the hunks apply to. A plain (non-git) diff whose
    ``---``/``+++`` names differ is not a rename: like GNU patch, patch the new name."""
    if (file.is_rename or file.is_deleted) and file.old_path:
        return file.old_path
    return file.path


def _precondition_problem(file: FilePatch, current: Reader) -> Optional[str]:
    """File-level reasons the hunks cannot even be tried."""
    if file.is_new:
        return "file already exists" if current(file.path) is not None else None
    source_path = _source_path(file)
    if current(source_path) is None:
        return "file does not exist"
    if file.is_rename and file.new_path != source_path and current(file.path) is not None:
        return f"rename target {file.path!r} already exists"
    return None


def _file_failure(file: FilePatch, problem: str) -> FileResult:
    hunks = tuple(
        HunkResult(file.path, index, hunk.header, "failed", 0, 0, None)
        for index, hunk in enumerate(file.hunks, 1)
    )
    return FileResult(file.path, _old_path_for_report(file), file.action, hunks, problem)


def _old_path_for_report(file: FilePatch) -> Optional[str]:
    return file.old_path if file.old_path not in (None, file.path) else None


def _holds_result(patch: Patch, read: Reader) -> bool:
    """True when the ``index`` blob ids say every file already has the patched content."""
    checked = False
    for file in patch.files:
        if file.is_deleted:
            if read(file.path) is not None:
                return False
            continue
        content = read(file.path)
        if content is None or not blob_matches(content, file.new_blob):
            return False
        if file.is_rename and file.old_path and read(file.old_path) is not None:
            return False
        checked = True
    return checked


def _already_applied(patch: Patch, undone: _Attempt) -> PatchResult:
    """Report the reverse pass in the forward patch's terms (paths, actions, headers)."""
    files = []
    for file, result in zip(patch.files, reversed(undone.files)):
        hunks = tuple(
            replace(found, file=file.path, header=hunk.header)
            for found, hunk in zip(result.hunks, file.hunks)
        )
        files.append(FileResult(file.path, _old_path_for_report(file), file.action, hunks))
    return PatchResult(patch.name, "already-applied", tuple(files), {})


# --- hunks of one file ----------------------------------------------------------------------


def patch_text(
    text: str,
    hunks: tuple[Hunk, ...],
    *,
    path: str,
    max_fuzz: int = 0,
    max_offset: Optional[int] = None,
    report: bool = True,
    find_nearest: bool = True,
) -> tuple[Optional[str], tuple[HunkResult, ...]]:
    """Apply ``hunks`` to one file's text. Returns the new text (None if any hunk failed)
    and every hunk's result. Lines outside the hunks, and context lines, are copied from the
    file, so its line endings survive; added lines take the file's ending when the hunk's
    endings had to be ignored to match (LF patch on a CRLF file or the other way round).
    With ``report=False`` it stops at the first failed hunk without searching for the
    nearest match (used by the passes whose failures nobody sees); with ``find_nearest=False`` it
    reports every hunk's outcome but does not search for a failed hunk's nearest match."""
    lines = split_lines(text)
    file_uses_crlf = uses_crlf(lines)
    cr_blind_lines: Optional[list[str]] = None
    token_indexes: dict[bool, TokenIndex] = {}  # keyed by "compared with CRs"
    output: list[str] = []
    results: list[HunkResult] = []
    cursor = 0
    drift = 0
    for index, hunk in enumerate(hunks, 1):
        header_index = expected_index(hunk)
        expected = header_index + drift
        used, keys = hunk, lines
        placement = locate(keys, used, expected, max_fuzz, cursor, max_offset=max_offset)
        ending = "\n"
        if placement is None and _endings_differ(hunk, file_uses_crlf):
            if cr_blind_lines is None:
                cr_blind_lines = [without_cr(line) for line in lines]
            used, keys = _without_cr_hunk(hunk), cr_blind_lines
            placement = locate(keys, used, expected, max_fuzz, cursor, max_offset=max_offset)
            ending = "\r\n" if file_uses_crlf else "\n"
        if placement is None:
            if not report or not find_nearest:
                results.append(HunkResult(path, index, hunk.header, "failed", 0, 0, None))
                if not report:
                    return None, tuple(results)
                continue
            literal = keys is lines
            if literal not in token_indexes:
                token_indexes[literal] = TokenIndex(keys)
            token_index = token_indexes[literal]
            results.append(_failed_result(path, index, hunk, keys, used, expected, token_index))
            continue
        rendered, end = _render(lines, used, placement, ending)
        output.extend(lines[cursor : placement.start])
        output.extend(rendered)
        cursor = end
        drift = placement.start - placement.trim_head - header_index
        results.append(_placed_result(path, index, hunk, placement, drift))
    if any(result.failed for result in results):
        return None, tuple(results)
    output.extend(lines[cursor:])
    return "".join(output), tuple(results)


def _endings_differ(hunk: Hunk, file_uses_crlf: bool) -> bool:
    """True when every hunk line is CRLF and the file mostly LF, or the other way round;
    a hunk with mixed endings is taken literally."""
    texts = [text for _, text in hunk.lines]
    with_cr = sum(1 for text in texts if text.endswith("\r"))
    if with_cr == 0:
        return file_uses_crlf
    if with_cr == len(texts):
        return not file_uses_crlf
    return False


def _without_cr_hunk(hunk: Hunk) -> Hunk:
    return replace(
        hunk,
        lines=tuple(
            (kind, text[:-1] if text.endswith("\r") else text) for kind, text in hunk.lines
        ),
    )


def _render(
    lines: list[str], hunk: Hunk, placement: Placement, ending: str
) -> tuple[list[str], int]:
    """The placed hunk's new text: context copied from the file, added lines written with
    ``ending`` (or none for a last line marked "no newline"). Returns it and the index of
    the first file line after the replaced block."""
    last_new = max(
        (i for i, (kind, _) in enumerate(hunk.lines) if kind != REMOVED), default=-1
    )
    stop = len(hunk.lines) - placement.trim_tail
    rendered = []
    position = placement.start
    for i in range(placement.trim_head, stop):
        kind, text = hunk.lines[i]
        if kind == CONTEXT:
            rendered.append(lines[position])
            position += 1
        elif kind == REMOVED:
            position += 1
        elif hunk.new_no_newline and i == last_new:
            rendered.append(text)
        else:
            rendered.append(text + ending)
    return rendered, position


def _placed_result(
    path: str, index: int, hunk: Hunk, placement: Placement, offset: int
) -> HunkResult:
    if placement.fuzz:
        outcome = "fuzz"
    elif offset:
        outcome = "offset"
    else:
        outcome = "exact"
    first = placement.start - placement.trim_head if hunk.old_lines else placement.start
    return HunkResult(path, index, hunk.header, outcome, offset, placement.fuzz, max(first, 0) + 1)


def _failed_result(
    path: str,
    index: int,
    hunk: Hunk,
    keys: list[str],
    used: Hunk,
    expected: int,
    token_index: TokenIndex,
) -> HunkResult:
    line, similarity = nearest(keys, used, expected, index=token_index)
    return HunkResult(
        path, index, hunk.header, "failed", 0, 0, None, nearest_line=line, similarity=similarity
    )
