"""Keep the catalogue's copies of the replacement package identical to megaport's one source.

The replacement code (softmax functions, apex stand-ins, backend resolution) lives once, in
``megaport/replacements/rocm_port/``. The catalogue carries it once too, in the shared port
patches that every series with a ``[[port]]`` variant lists first (:mod:`megaport.portpatches`,
written whole). A series without a port carries the package in a patch of its own, where only
the package's diff sections are rewritten. Regenerating also sets each series' own patches' Upstream-Range
trailer, and stores once, under ``shared/``, every patch that several series carry byte for byte
but for that trailer (the shared copy carries one trailer per range). Running it on an unchanged
catalogue changes nothing, and ``--check`` fails when any copy differs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from megaport.catalogue import LIST_FILE, PORT_DIR, SHARED_DIR, Catalogue, PatchFile, PortVariant, Series, rewrite_list
from megaport.errors import MegaportError
from megaport.portpatches import port_patches
from megaport.replacements import render


@dataclass(frozen=True)
class Regeneration:
    series: str
    patch: Path
    changed: bool
    removed: bool = False  # a copy now stored once in shared/, or a shared file no series lists


def git_blob_id(content: bytes) -> str:
    """The sha1 git gives a blob, for the diff's full-index line."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def new_file_section(path: str, content: bytes) -> bytes:
    """A git-style diff that creates ``path`` with ``content`` (what format-patch --full-index writes)."""
    lines = content.splitlines(keepends=True)
    out = [
        f"diff --git a/{path} b/{path}\n".encode(),
        b"new file mode 100644\n",
        f"index {'0' * 40}..{git_blob_id(content)}\n".encode(),
        b"--- /dev/null\n",
        f"+++ b/{path}\n".encode(),
        f"@@ -0,0 +1{',' + str(len(lines)) if len(lines) != 1 else ''} @@\n".encode(),
    ]
    for line in lines:
        out.append(b"+" + line)
    if lines and not lines[-1].endswith(b"\n"):
        out.append(b"\n\\ No newline at end of file\n")
    return b"".join(out)


def replace_section(patch_text: bytes, path: str, section: bytes) -> bytes:
    """Swap the diff section for ``path`` inside a patch, leaving every other byte alone."""
    header = f"diff --git a/{path} b/{path}\n".encode()
    start = patch_text.find(header)
    if start < 0 or (start > 0 and patch_text[start - 1 : start] != b"\n"):
        raise MegaportError(f"no diff section for {path} in the patch")
    end = patch_text.find(b"\ndiff --git ", start + len(header))
    signature = patch_text.find(b"\n-- \n", start + len(header))
    stops = [i + 1 for i in (end, signature) if i >= 0]
    stop = min(stops) if stops else len(patch_text)
    return patch_text[:start] + section + patch_text[stop:]


TRAILER = b"Upstream-Range: "


def upstream_range(series: Series) -> str:
    """'first..last' of the tested refs; a branch entry carries its date ('main@2026-08-22')."""
    if not series.tested:
        return "untested"
    return f"{series.tested[0].label}..{series.tested[-1].label}"


def with_range_trailers(patch_text: bytes, ranges: list[str]) -> bytes:
    """Set the message's Upstream-Range trailers (the message ends where the diff begins), one line
    per range in order, none for an empty list: a patch several series share names each range."""
    starts = [i for i in (patch_text.find(b"\n---\n"), patch_text.find(b"\ndiff --git ")) if i >= 0]
    if not starts:
        raise MegaportError("patch has no diff")
    end = min(starts) + 1
    message = patch_text[:end].rstrip(b"\n").split(b"\n")
    message = [line for line in message if not line.startswith(TRAILER)]
    while message and message[-1] == b"":
        message.pop()
    trailers = b"".join(TRAILER + text.encode() + b"\n" for text in ranges)
    return b"\n".join(message) + b"\n\n" + (trailers + b"\n" if trailers else b"") + patch_text[end:]


def rendered_replacement(series: Series) -> dict[str, bytes]:
    """The package's files for the series: ``{path in the tree: bytes}``."""
    files = render(fully_masked_rows_are_zero=series.fully_masked_rows == "zero",
                   transformer_engine_imports_guarded=series.transformer_engine_imports_guarded,
                   tree_path=series.replacement)
    return {path: text.encode("utf-8") for path, text in files.items()}


def replace_package_sections(patch_text: bytes, folder: str, sections: bytes) -> bytes:
    """Swap every diff section for a file under ``folder`` for ``sections``, placed where the first
    of them was (so files added to or dropped from the package follow), every other byte alone."""
    header = f"diff --git a/{folder}/".encode()
    first = patch_text.find(header)
    if first < 0 or (first > 0 and patch_text[first - 1: first] != b"\n"):
        raise MegaportError(f"no diff section for {folder}/ in the patch")
    signature = patch_text.find(b"\n-- \n", first)
    end = signature + 1 if signature >= 0 else len(patch_text)
    # Hunk lines start with ' ', '+' or '-': a line starting "diff --git " begins a section.
    parts = re.split(rb"(?m)^(?=diff --git )", patch_text[first:end])
    others = b"".join(part for part in parts if not part.startswith(header))
    return patch_text[:first] + sections + others + patch_text[end:]


def replacement_patch(series: Series) -> Path:
    """The one patch of a series that creates the replacement package."""
    header = f"diff --git a/{series.replacement}/".encode()
    owners = [p.path for p in series.patches if header in p.path.read_bytes()]
    if len(owners) != 1:
        raise MegaportError(
            f"series {series.name}: expected one patch creating {series.replacement}, found {len(owners)}"
        )
    return owners[0]


def regenerate_ports(root: Path, ports: tuple[PortVariant, ...], *, write: bool) -> list[Regeneration]:
    """Write the shared port patches (:mod:`megaport.portpatches`): the base once, then each
    variant's own, creating a new variant's folder."""
    wanted = {}
    for variant in ports:
        for patch in port_patches(variant):
            wanted[patch.path(root)] = (f"{PORT_DIR}/{patch.folder}", patch.data)
    return _write_patches(wanted, write)


@dataclass
class _Copy:
    """One patch as the series lists it: the series, the patch and its bytes without range trailers."""

    series: Series
    patch: PatchFile
    body: bytes


def regenerate_series(catalogue: Catalogue, *, write: bool) -> list[Regeneration]:
    """Every series' own patches: the package in a series that carries it in a patch of its own
    (no port), the range trailers, and one file for the patches several series carry (a port
    variant's files are left to :func:`regenerate_ports`)."""
    groups: dict[bytes, list[_Copy]] = {}
    for copy in _own_copies(catalogue):
        groups.setdefault(copy.body, []).append(copy)
    wanted: dict[Path, tuple[str, bytes]] = {}
    entries: dict[str, dict[str, str]] = {series.name: {} for series in catalogue.series}
    for copies in groups.values():
        path, entry = _home(catalogue.root, copies)
        ranges = list(dict.fromkeys(upstream_range(copy.series) for copy in copies))
        label = f"{SHARED_DIR}/{path.parent.name}" if entry != path.name else copies[0].series.name
        wanted[path] = (label, with_range_trailers(copies[0].body, ranges))
        for copy in copies:
            entries[copy.series.name][copy.patch.entry] = entry
    return (_write_patches(wanted, write) + _write_lists(catalogue, entries, write)
            + _remove_stale(catalogue, set(wanted), write))


def _own_copies(catalogue: Catalogue) -> list[_Copy]:
    """Each series' patches other than the port's, in catalogue order, the package re-rendered."""
    copies = []
    for series in catalogue.series:
        owner = replacement_patch(series) if series.replacement and not series.port else None
        for patch_file in series.patches:
            if patch_file.port:
                continue
            body = with_range_trailers(patch_file.path.read_bytes(), [])
            if patch_file.path == owner:
                sections = b"".join(new_file_section(path, content)
                                    for path, content in rendered_replacement(series).items())
                body = replace_package_sections(body, series.replacement, sections)
            copies.append(_Copy(series, patch_file, body))
    return copies


def _home(root: Path, copies: list[_Copy]) -> tuple[Path, str]:
    """Where one patch is stored and how lists name it: in its series' folder when one series
    carries it, else once as ``shared/<first series>/<its file name there>``."""
    first = copies[0]
    if len({copy.series.name for copy in copies}) == 1:
        if len(copies) > 1:
            raise MegaportError(f"series {first.series.name} lists {first.patch.name} twice (the same patch)")
        return first.series.directory / first.patch.name, first.patch.name
    entry = f"../{SHARED_DIR}/{first.series.name}/{first.patch.name}"
    return root / SHARED_DIR / first.series.name / first.patch.name, entry


def _write_patches(wanted: dict[Path, tuple[str, bytes]], write: bool) -> list[Regeneration]:
    results = []
    for path, (label, data) in wanted.items():
        changed = not path.is_file() or path.read_bytes() != data
        if write and changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        results.append(Regeneration(label, path, changed))
    return results


def _write_lists(catalogue: Catalogue, entries: dict[str, dict[str, str]], write: bool) -> list[Regeneration]:
    """Each list file naming each patch where it is now stored."""
    results = []
    for series in catalogue.series:
        listing = series.directory / LIST_FILE
        before = listing.read_text(encoding="utf-8")
        renames = {old: new for old, new in entries[series.name].items() if old != new}
        after = rewrite_list(before, renames)
        if write and after != before:
            listing.write_text(after, encoding="utf-8")
        results.append(Regeneration(series.name, listing, after != before))
    return results


def _remove_stale(catalogue: Catalogue, wanted: set[Path], write: bool) -> list[Regeneration]:
    """The copies a shared file replaces, and shared files no series lists any more."""
    stale = {p.path for s in catalogue.series for p in s.patches if not p.port} - wanted
    shared = catalogue.root / SHARED_DIR
    stale |= {path for path in shared.glob("*/*.patch") if path not in wanted} if shared.is_dir() else set()
    results = []
    for path in sorted(stale):
        if write:
            path.unlink(missing_ok=True)
            for folder in (path.parent, shared):  # shared/ and its folders go when emptied
                if folder.is_relative_to(shared) and folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        results.append(Regeneration(path.parent.name, path, True, removed=True))
    return results


def regenerate(catalogue: Catalogue, *, write: bool) -> list[Regeneration]:
    """Everything generated in a catalogue; write only when asked (``--check`` does not)."""
    return regenerate_ports(catalogue.root, catalogue.ports, write=write) + regenerate_series(catalogue, write=write)
