"""Check a series against one upstream tree, hunk by hunk, without writing anything.

Every patch is tried on upstream's files plus what the earlier patches of the series wrote
(like ``plan_series``), but a failing patch does not stop the check: each hunk gets its own
word (see :mod:`megaport.drift.model`) so one report shows everything that needs refreshing.

For each hunk, in this order:

1. the engine places it (``exact`` → clean, ``offset``, ``fuzz`` up to ``max_fuzz``); a patch
   the engine finds already applied (reverse-applies, or the ``index`` blob ids say so) has
   every hunk ``applied``;
2. a hunk that does not place but whose reverse does is ``applied`` (upstream took that change);
3. otherwise the patch's preimage blob is read from the repository (``index <old>..<new>``), the
   hunk is applied to it and three-way merged with upstream's file: a clean merge is ``3way``;
4. otherwise ``conflict``, with the nearest matching location and how similar it is.

A file the patch changes that upstream no longer has is ``missing``, with its likely new path.
When a patch fails, later patches see the files it could not change as upstream has them, so
their results after a conflict can be pessimistic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Callable, Optional

from megaport.catalogue import PatchFile, Series
from megaport.engine import FilePatch, Hunk, HunkResult, Patch, apply_patch, check_patch_paths, parse_patch
from megaport.engine.apply import patch_text, reverse_patch
from megaport.engine.blob import git_blob_id
from megaport.engine.text import decode, encode

from .merge import merge3
from .model import (
    APPLIED, CLEAN, CONFLICT, FUZZ, MISSING, OFFSET, SKIPPED, THREEWAY, HunkDrift, PatchDrift, SeriesDrift, worst,
)

Reader = Callable[[str], Optional[bytes]]
#: oid -> the blob's bytes, or None when the repository does not have it.
Preimages = Callable[[Optional[str]], Optional[bytes]]
#: (path, preimage bytes or None) -> (likely new path or None, what happened to the file).
Locator = Callable[[str, Optional[bytes]], tuple[Optional[str], str]]

_ENGINE_WORDS = {"exact": CLEAN, "offset": OFFSET, "fuzz": FUZZ}


@dataclass(frozen=True)
class LoadedPatch:
    """A parsed patch with the patch-file line of every hunk header (per file, per hunk)."""

    file: PatchFile
    patch: Patch
    hunk_lines: tuple[tuple[int, ...], ...]
    digest: str = ""  # sha256 of the patch text: what results are remembered by


def loaded_patch(patch_file: PatchFile, text: str) -> LoadedPatch:
    """Parse one patch (paths are checked like ``apply`` does)."""
    patch = parse_patch(text, name=patch_file.name)
    check_patch_paths(patch)
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    return LoadedPatch(patch_file, patch, hunk_header_lines(text, patch), digest)


@dataclass(frozen=True)
class LoadedSeries:
    series: Series
    patches: tuple[LoadedPatch, ...]


def load_series(series: Series) -> LoadedSeries:
    """Parse every patch of a series once (paths are checked like ``apply`` does)."""
    return LoadedSeries(series, tuple(loaded_patch(p, p.text()) for p in series.patches))


def hunk_header_lines(text: str, patch: Patch) -> tuple[tuple[int, ...], ...]:
    """1-based patch-file line of each hunk's ``@@`` header, per file of ``patch``."""
    lines = text.split("\n")
    starts = [f.patch_line for f in patch.files] + [len(lines) + 1]
    result = []
    for number, file in enumerate(patch.files):
        found = [
            i + 1
            for i in range(starts[number] - 1, min(starts[number + 1] - 1, len(lines)))
            if lines[i].startswith("@@ ")
        ]
        result.append(tuple(found[: len(file.hunks)]) + (None,) * max(len(file.hunks) - len(found), 0))
    return tuple(result)


def check_series(
    loaded: LoadedSeries,
    tree,
    *,
    ref: str,
    sha: str,
    reason: str = "",
    preimage: Preimages = lambda oid: None,
    locate_moved: Locator = lambda path, pre: (None, "file does not exist"),
    max_fuzz: int = 2,
    memo: Optional[dict] = None,
) -> SeriesDrift:
    """Check every patch of ``loaded`` on ``tree`` (``read``/``exists``). ``memo`` (a dict kept
    across calls) reuses a patch's result on refs where the files it touches are the same."""
    from megaport.plan import _skip_reason  # the same rule apply uses

    overlay: dict[str, Optional[bytes]] = {}

    def read(path: str) -> Optional[bytes]:
        return overlay[path] if path in overlay else tree.read(path)

    results = []
    for item in loaded.patches:
        skip = _skip_reason(item.patch, loaded.series, tree)
        if skip:
            results.append(
                PatchDrift(item.file.name, item.patch.subject, item.file.path, SKIPPED, (), reason=skip)
            )
            continue
        drift, writes = check_patch(
            item, read, preimage=preimage, locate_moved=locate_moved, max_fuzz=max_fuzz, memo=memo,
        )
        overlay.update(writes)
        results.append(drift)
    return SeriesDrift(ref, sha, loaded.series.name, tuple(results), reason, series_dir=loaded.series.directory)


def check_patch(
    item: LoadedPatch,
    read: Reader,
    *,
    preimage: Preimages = lambda oid: None,
    locate_moved: Locator = lambda path, pre: (None, "file does not exist"),
    max_fuzz: int = 2,
    memo: Optional[dict] = None,
) -> tuple[PatchDrift, dict[str, Optional[bytes]]]:
    """One patch on the files ``read`` returns, and what the next patch should see.

    ``PatchDrift.after`` is set when the patch applies one way or another. When it does not,
    the files it could still change are returned all the same, so later patches are judged on
    as much of the series as possible.
    """
    patch = item.patch
    touched = sorted({p for f in patch.files for p in (f.old_path, f.new_path) if p})
    before = {path: read(path) for path in touched}
    key = None
    if memo is not None:
        # The result depends only on the patch and the bytes of the files it touches; a result
        # with missing files also on the commit (where did they go?), so those are not kept.
        key = (item.digest, item.file.name, max_fuzz, tuple((p, None if c is None else git_blob_id(c)) for p, c in before.items()))
        if key in memo:
            return memo[key]
    found = _check_patch(item, read, before, preimage=preimage, locate_moved=locate_moved, max_fuzz=max_fuzz)
    if key is not None and found[0].status != MISSING and not any(h.status == MISSING for h in found[0].hunks):
        memo[key] = found
    return found


def _check_patch(item, read, before, *, preimage, locate_moved, max_fuzz):
    patch = item.patch
    result = apply_patch(patch, read, max_fuzz=max_fuzz)
    hunks: list[HunkDrift] = []
    writes: dict[str, Optional[bytes]] = {}
    resolved = True
    if result.status == "applied":
        for file_result, lines in zip(result.files, item.hunk_lines):
            hunks.extend(_placed(h, _line_of(lines, h)) for h in file_result.hunks)
        writes = dict(result.changes)
    elif result.status == "already-applied":
        for file_result, lines in zip(result.files, item.hunk_lines):
            hunks.extend(
                _hunk(h, APPLIED, _line_of(lines, h), line=h.line, reason="upstream already contains this patch")
                for h in file_result.hunks
            )
    else:
        def current(path: str) -> Optional[bytes]:
            return writes[path] if path in writes else read(path)

        for file_patch, file_result, lines in zip(patch.files, result.files, item.hunk_lines):
            file_hunks, file_writes = _check_file(
                file_patch, file_result.hunks, file_result.error, lines, current,
                preimage=preimage, locate_moved=locate_moved, max_fuzz=max_fuzz,
            )
            hunks.extend(file_hunks)
            if file_writes is None:
                resolved = False
            else:
                writes.update(file_writes)
    status = worst((h.status for h in hunks), default=CLEAN)
    after = {**before, **writes} if resolved else None
    drift = PatchDrift(item.file.name, patch.subject, item.file.path, status, tuple(hunks), before=before, after=after)
    return drift, writes


def _check_file(
    file: FilePatch,
    engine_hunks: tuple[HunkResult, ...],
    error: Optional[str],
    lines: tuple[Optional[int], ...],
    current: Reader,
    *,
    preimage: Preimages,
    locate_moved: Locator,
    max_fuzz: int,
) -> tuple[list[HunkDrift], Optional[dict[str, Optional[bytes]]]]:
    """Hunk words for one file of a patch that failed, and what the file becomes (None: it
    cannot be resolved)."""
    source = file.old_path if (file.is_rename or file.is_deleted) and file.old_path else file.path
    if error is not None:
        return _file_error(file, engine_hunks, error, lines, current, source, preimage, locate_moved)
    if not any(found.failed for found in engine_hunks):
        # This file is fine; another file of the patch is not. Apply just this one.
        alone = apply_patch(Patch("", "", "", None, None, (file,)), current, max_fuzz=max_fuzz)
        return [_placed(found, _line_of(lines, found)) for found in engine_hunks], dict(alone.changes)
    content = current(source)
    assert content is not None
    text = decode(content)
    pre: Optional[bytes] = None
    pre_loaded = False
    words: list[HunkDrift] = []
    for hunk, found in zip(file.hunks, engine_hunks):
        where = _line_of(lines, found)
        if not found.failed:
            words.append(_placed(found, where))
            continue
        landed = _reverse_lands(hunk, text, file.path)
        if landed is not None:
            words.append(_hunk(found, APPLIED, where, line=landed))
            continue
        if not pre_loaded:
            pre, pre_loaded = preimage(file.old_blob), True
        if pre is not None and _merges(pre, hunk, content, file.path):
            words.append(_hunk(found, THREEWAY, where))
            continue
        note = None
        if pre is None and file.old_blob and set(file.old_blob) != {"0"}:
            note = f"no 3-way merge: preimage blob {file.old_blob[:12]} is not in the repository"
        words.append(
            _hunk(found, CONFLICT, where, nearest_line=found.nearest_line, similarity=found.similarity, reason=note)
        )
    if any(w.status == CONFLICT for w in words):
        return words, None
    new = _resolve(file, words, content, pre, max_fuzz)
    if new is None:
        words = [
            replace(w, status=CONFLICT, reason="the 3-way merge of the whole file conflicts")
            if w.status == THREEWAY else w
            for w in words
        ]
        return words, None
    writes: dict[str, Optional[bytes]] = {file.path: new}
    if file.is_rename and source != file.path:
        writes[source] = None
    return words, writes


def _file_error(file, engine_hunks, error, lines, current, source, preimage, locate_moved):
    """A file-level failure: missing file, file that already exists, leftovers on delete."""
    def each(status, **extra):
        return [_hunk(h, status, _line_of(lines, h), **extra) for h in engine_hunks]

    if error == "file does not exist":
        if file.is_deleted:
            return each(APPLIED, reason="upstream already deleted the file"), {}
        new_path, why = locate_moved(source, preimage(file.old_blob))
        return each(MISSING, new_path=new_path, reason=why), None
    if file.is_new and error == "file already exists":
        wanted, _ = patch_text("", file.hunks, path=file.path)
        if wanted is not None and current(file.path) == encode(wanted):
            return each(APPLIED, line=1, reason="upstream already has the file"), {}
        return each(CONFLICT, reason="upstream already has a different file here"), None
    return each(CONFLICT, reason=error), None


def _resolve(file: FilePatch, words: list[HunkDrift], content: bytes, pre: Optional[bytes], max_fuzz: int) -> Optional[bytes]:
    """The file with the patch in it, once no hunk conflicts (None: the whole-file merge conflicts)."""
    if any(w.status == THREEWAY for w in words):
        assert pre is not None
        ours, _ = patch_text(decode(pre), file.hunks, path=file.path, max_fuzz=0, max_offset=None)
        if ours is None:
            return None
        merged, conflicts = merge3(pre, encode(ours), content)
        return merged if not conflicts else None
    remaining = tuple(h for h, w in zip(file.hunks, words) if w.status != APPLIED)
    if not remaining:
        return content
    new, _ = patch_text(decode(content), remaining, path=file.path, max_fuzz=max_fuzz)
    return encode(new) if new is not None else None


def _reverse_lands(hunk: Hunk, text: str, path: str) -> Optional[int]:
    """Line where the hunk's result already sits in ``text`` (its reverse applies), else None."""
    if not any(kind != " " for kind, _ in hunk.lines):
        return None
    undo = reverse_patch(Patch("", "", "", None, None, (FilePatch(path, path, (hunk,)),))).files[0].hunks[0]
    new, results = patch_text(text, (undo,), path=path, max_fuzz=0, max_offset=None, report=False)
    return results[0].line if new is not None else None


def _merges(pre: bytes, hunk: Hunk, content: bytes, path: str) -> bool:
    """True when the hunk alone, applied to its preimage, merges cleanly into ``content``."""
    ours, _ = patch_text(decode(pre), (hunk,), path=path, max_fuzz=0, max_offset=None, report=False)
    if ours is None:
        return False
    _, conflicts = merge3(pre, encode(ours), content)
    return conflicts == 0


def _line_of(lines: tuple[Optional[int], ...], found: HunkResult) -> Optional[int]:
    return lines[found.index - 1] if 0 < found.index <= len(lines) else None


def _placed(found: HunkResult, patch_line: Optional[int]) -> HunkDrift:
    return _hunk(found, _ENGINE_WORDS.get(found.outcome, CONFLICT), patch_line, line=found.line)


def _hunk(found: HunkResult, status: str, patch_line: Optional[int], **extra) -> HunkDrift:
    """A HunkDrift from the engine's result for the same hunk."""
    keep_place = status in (OFFSET, FUZZ, CLEAN)
    line = extra.pop("line", found.line if keep_place else None)
    return HunkDrift(
        file=found.file,
        index=found.index,
        header=found.header,
        status=status,
        offset=found.offset if keep_place else 0,
        fuzz=found.fuzz if keep_place else 0,
        line=line,
        patch_line=patch_line,
        **extra,
    )
