"""Rebuild a series on a new upstream ref and export it deterministically.

A patch whose hunks are all clean on the ref keeps its file byte for byte; a shared port patch
(``port/``) must be one of those, since other series take it too, and the refreshed list names it
where the original did. A patch stored once for several series (``shared/``) stays there when it is
kept; regenerated, the series gets its own copy (``megaport regenerate`` shares it again if another
series carries the same). A patch with hunks that moved (offset), needed fuzz or a three-way merge
is regenerated file by file: each file section whose hunks are all clean is kept verbatim; the
others are rediffed with three lines of context from the ref's file (``engine.make_file_diff``),
with new full blob ids on the ``index`` line and the original file mode. The mail header and
message stay as they were. A patch whose every change upstream already has is dropped. Nothing
is written unless the rebuilt series applies to the ref with every hunk clean.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megaport.catalogue import CATALOGUE_FILE, LIST_FILE, Catalogue, PatchFile, Series, rewrite_list
from megaport.engine import make_file_diff
from megaport.engine.diff import with_function_names
from megaport.errors import MegaportError

from .check import LoadedPatch, LoadedSeries, check_series, loaded_patch
from .model import BROKEN, CLEAN, EXIT_BROKEN, SKIPPED, PatchDrift, SeriesDrift

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KEPT = "kept"
REGENERATED = "regenerated"
DROPPED = "dropped"

_INDEX_MODE = re.compile(r"^index [0-9a-f]+\.\.[0-9a-f]+ ([0-7]{6})$", re.MULTILINE)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class ExportedPatch:
    """One patch of the refreshed series: what happened to it and its new bytes (None: dropped)."""

    name: str
    action: str
    data: Optional[bytes]
    note: str = ""


def conflicts_message(result: SeriesDrift) -> list[str]:
    """Every hunk that stops a refresh, one line each."""
    return [
        f"{patch.name}: {hunk.detail}"
        for patch in result.patches
        for hunk in patch.hunks
        if hunk.status in BROKEN
    ]


def rebuild(loaded: LoadedSeries, result: SeriesDrift) -> list[ExportedPatch]:
    """The refreshed patches, in series order. ``result`` must have no conflict or missing file."""
    if result.status in BROKEN:
        raise MegaportError(f"series {result.series} does not apply to {result.ref}; nothing to rebuild")
    exported = []
    for item, drift in zip(loaded.patches, result.patches):
        original = item.file.path.read_bytes()
        if item.file.port and drift.status != SKIPPED and not all(h.status == CLEAN for h in drift.hunks):
            raise MegaportError(
                f"{item.file.name} is shared by every series of port '{item.file.port}' and does not apply cleanly "
                f"on {result.ref}; fix the replacement source or the [[port]] variant, then 'megaport regenerate'",
                exit_code=EXIT_BROKEN)
        if drift.status == SKIPPED:
            exported.append(ExportedPatch(item.file.name, KEPT, original, f"not checked ({drift.reason})"))
        elif all(h.status == CLEAN for h in drift.hunks):
            exported.append(ExportedPatch(item.file.name, KEPT, original))
        else:
            exported.append(_regenerate(item, drift, original))
    return exported


def _regenerate(item: LoadedPatch, drift: PatchDrift, original: bytes) -> ExportedPatch:
    assert drift.after is not None, "a patch without conflicts has new contents"
    text = original.decode("utf-8", "surrogateescape")
    lines = text.split("\n")
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    patch = item.patch
    starts = [f.patch_line - 1 for f in patch.files]
    last_end = _hunks_end(lines, item, len(patch.files) - 1)
    ends = starts[1:] + [last_end]
    head = "".join(lines[: starts[0]])
    tail = "".join(lines[last_end:])
    sections = []
    changed = []
    for number, (file, start, end) in enumerate(zip(patch.files, starts, ends)):
        words = [h for h in drift.hunks if h.file == file.path]
        section = "".join(lines[start:end])
        if all(h.status == CLEAN for h in words):
            sections.append(section)
            continue
        if file.is_rename:
            raise MegaportError(f"{item.file.name}: cannot refresh the rename of {file.old_path}; refresh it by hand")
        source = file.old_path if file.is_deleted and file.old_path else file.path
        old = drift.before.get(source)
        new = drift.after.get(file.path) if not file.is_deleted else None
        diff = make_file_diff(file.path, old, new)
        if not diff:
            continue  # upstream has this file's change: nothing left to carry
        diff = with_function_names(diff, old)
        mode = _INDEX_MODE.search(section)
        if mode and old is not None and new is not None:
            diff = re.sub(r"^(index [0-9a-f]+\.\.[0-9a-f]+) 100644$", rf"\g<1> {mode.group(1)}", diff, count=1, flags=re.MULTILINE)
        sections.append(diff)
        changed.append(file.path)
    if not sections:
        return ExportedPatch(item.file.name, DROPPED, None, "upstream already contains every change")
    data = (head + "".join(sections) + tail).encode("utf-8", "surrogateescape")
    words = sorted({h.label for h in drift.hunks if h.status != CLEAN})
    return ExportedPatch(item.file.name, REGENERATED, data, f"{', '.join(changed)} ({'; '.join(words)})")


def _hunks_end(lines: list[str], item: LoadedPatch, number: int) -> int:
    """Index just after the last hunk of file ``number`` (where a signature or trailer starts)."""
    file = item.patch.files[number]
    if not file.hunks or item.hunk_lines[number][-1] is None:
        return len(lines)
    hunk = file.hunks[-1]
    index = item.hunk_lines[number][-1]  # 1-based header line = 0-based first body line
    old = new = 0
    while index < len(lines) and (old < hunk.source_length or new < hunk.target_length):
        kind = lines[index][:1]
        if kind == "-":
            old += 1
        elif kind == "+":
            new += 1
        elif kind in (" ", "\n", "\r"):
            old += 1
            new += 1
        index += 1
    while index < len(lines) and lines[index].startswith("\\"):
        index += 1
    return index


def loaded_from_exports(series: Series, exported: list[ExportedPatch], directory: Path) -> LoadedSeries:
    """The refreshed series, parsed from memory, to check it before anything is written."""
    items = []
    for original, patch in zip(series.patches, exported):
        if patch.data is None:
            continue
        text = patch.data.decode("utf-8", "surrogateescape")
        if own_copy(original, patch):
            items.append(loaded_patch(PatchFile(patch.name, directory / patch.name), text))
        else:
            items.append(loaded_patch(original, text))
    return LoadedSeries(series, tuple(items))


def verify(series: Series, exported: list[ExportedPatch], tree, result: SeriesDrift) -> None:
    """The rebuilt series must apply to the ref with every hunk clean."""
    loaded = loaded_from_exports(series, exported, series.directory)
    again = check_series(loaded, tree, ref=result.ref, sha=result.sha, max_fuzz=0)
    bad = [f"{p.name}: {h.detail}" for p in again.patches for h in p.hunks if h.status != CLEAN]
    if bad:
        raise MegaportError(f"the refreshed series does not apply cleanly to {result.ref} (a megaport bug): {bad[0]}")


# --- writing --------------------------------------------------------------------------------


def own_copy(original: PatchFile, patch: ExportedPatch) -> bool:
    """Whether the refreshed series carries the patch in its own folder: not a port patch, not
    dropped, and not a ``shared/`` patch kept as it is."""
    return not original.port and patch.data is not None and not (original.shared and patch.action == KEPT)


def list_file_text(series: Series, exported: list[ExportedPatch]) -> bytes:
    """The series list file with dropped patches' lines removed and regenerated shared patches named
    by their own copy (comments and order kept)."""
    renames: dict[str, str | None] = {}
    for original, patch in zip(series.patches, exported):
        if patch.data is None:
            renames[original.entry] = None
        elif original.shared and own_copy(original, patch):
            renames[original.entry] = patch.name
    original = (series.directory / LIST_FILE).read_bytes()
    if not renames:
        return original
    return rewrite_list(original.decode("utf-8"), renames).encode("utf-8")


def write_new_series(
    catalogue: Catalogue, series: Series, exported: list[ExportedPatch], new_name: str, ref: str, sha: str
) -> Path:
    """A new folder ``new_name`` beside the others and its catalogue entry, appended as text."""
    if not _NAME.match(new_name):
        raise MegaportError(f"--as '{new_name}': use a plain folder name (letters, digits, . _ + -)", exit_code=3)
    if any(s.name == new_name for s in catalogue.series):
        raise MegaportError(f"series '{new_name}' already exists in {catalogue.root / CATALOGUE_FILE}", exit_code=3)
    target = catalogue.root / new_name
    if target.exists():
        raise MegaportError(f"{target} already exists; choose another --as name", exit_code=3)
    catalogue_file = catalogue.root / CATALOGUE_FILE
    before = catalogue_file.read_bytes()
    entry = catalogue_entry(before, series.name, new_name, ref, sha)
    tmp = Path(tempfile.mkdtemp(prefix=f".{new_name}.tmp-", dir=catalogue.root))
    try:
        for original, patch in zip(series.patches, exported):
            if own_copy(original, patch):  # a shared patch kept as it is stays shared
                (tmp / patch.name).write_bytes(patch.data)
        (tmp / LIST_FILE).write_bytes(list_file_text(series, exported))
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        separator = b"" if before.endswith(b"\n") or not before else b"\n"
        with catalogue_file.open("ab") as handle:
            handle.write(separator + entry)
    except BaseException:
        catalogue_file.write_bytes(before)
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def write_in_place(series: Series, exported: list[ExportedPatch]) -> list[str]:
    """Rewrite the patches whose bytes change (and drop dropped ones); return what changed."""
    changed = []
    directory = series.directory
    for original, patch in zip(series.patches, exported):
        path = directory / patch.name
        if not own_copy(original, patch):  # port patches are only ever kept, shared ones stay kept
            continue
        if not path.is_file() or path.read_bytes() != patch.data:
            _atomic_write(path, patch.data)
            changed.append(patch.name)
    listing = list_file_text(series, exported)
    if listing != (directory / LIST_FILE).read_bytes():
        _atomic_write(directory / LIST_FILE, listing)
        changed.append(LIST_FILE)
    for patch in exported:
        if patch.data is None and (directory / patch.name).exists():
            (directory / patch.name).unlink()
            changed.append(patch.name)
    return changed


def _atomic_write(path: Path, data: bytes) -> None:
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- the catalogue entry ----------------------------------------------------------------------


def catalogue_entry(catalogue_text: bytes, old_name: str, new_name: str, ref: str, sha: str) -> bytes:
    """TOML for a copy of ``old_name``'s entry named ``new_name``, tested on ``ref`` only."""
    data = tomllib.loads(catalogue_text.decode("utf-8"))
    entry = next((e for e in data.get("series", []) if e.get("name") == old_name), None)
    if entry is None:
        raise MegaportError(f"series '{old_name}' has no entry in {CATALOGUE_FILE}")
    entry = dict(entry)
    entry["name"] = new_name
    entry["tested"] = [{"ref": ref, "sha": sha}]
    out = [f"# Refreshed from {old_name} on {ref} ({sha[:12]}) by megaport refresh.\n", "[[series]]\n"]
    tables = []
    for key, value in entry.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif key == "tested":
            out.append("tested = [\n" + "".join(f"  {_toml(t)},\n" for t in value) + "]\n")
        else:
            out.append(f"{_key(key)} = {_toml(value)}\n")
    for key, table in tables:
        out.append(f"\n[series.{_key(key)}]\n")
        out.extend(f"{_key(k)} = {_toml(v)}\n" for k, v in table.items())
    return ("\n" + "".join(out)).encode("utf-8")


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    raise MegaportError(f"cannot copy catalogue value {value!r} (dates and times are not supported)")
