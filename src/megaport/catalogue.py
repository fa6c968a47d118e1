"""The series catalogue: which patch series exist, what they are tested on, how a tree is recognised.

The catalogue is data (``patches/catalogue.toml`` plus one folder per series), so users can point
megaport at their own with ``--patches DIR`` or ``MEGAPORT_PATCHES`` without touching the code.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megaport.errors import MegaportError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CATALOGUE_FILE = "catalogue.toml"
LIST_FILE = "series"
# Folder (beside the series folders) of the patches series share: ``base/`` creates the replacement
# package, ``<variant>/`` fits it to a [[port]] variant's trees; a series list names them as
# ``../port/<folder>/<patch>`` (megaport.portpatches writes them).
PORT_DIR = "port"
PORT_BASE = "base"
# Folder (beside the series folders) of the series' own patches that several series carry byte for
# byte but for their range trailers: each is stored once, as ``shared/<first series>/<file>`` (the
# first series in catalogue order that lists it), and listed by its path from each series folder
# (megaport.regenerate writes them).
SHARED_DIR = "shared"
# Folders beside the series folders that hold patches the series lists name by relative path.
COMMON_DIRS = (PORT_DIR, SHARED_DIR)
PATCHES_ENV = "MEGAPORT_PATCHES"
# The repository a series' tested refs are resolved in, unless its entry names another one.
UPSTREAM_REPOSITORY = "NVIDIA/Megatron-LM"


# The lines of upstream development a tested ref can be on, in the order ``megaport series`` lists
# them: main's first-parent history (its tags included), release branches (core_r*, their core_v*
# tags), the dev branch, dated alpha/beta branches (26.04-alpha), and feature branches (dsv4; a
# commit merged into main off its first-parent line, such as InstructRetro).
LINES = ("main", "release", "dev", "alpha", "feature")


def line_of(ref: str) -> str:
    """The line a ref's name says it is on, for a ``tested`` entry that does not name its line
    (a tag on main's first-parent line, such as v2.0 or 23.04, has to)."""
    if ref in ("main", "master"):
        return "main"
    if ref.startswith(("core_v", "core_r")):
        return "release"
    if ref == "dev":
        return "dev"
    if ref.endswith(("-alpha", "-beta")):
        return "alpha"
    return "feature"


@dataclass(frozen=True)
class TestedRef:
    """An upstream ref a series is known to apply to with no fuzz, and the line it is on."""

    ref: str
    sha: str
    date: str | None = None
    line: str = "main"

    @property
    def label(self) -> str:
        """How people name it: the tag, or a branch with the commit's date ('main@2023-04-19')."""
        return f"{self.ref}@{self.date}" if self.date else self.ref


@dataclass(frozen=True)
class Recognise:
    """Facts of a tree that mark it as belonging to a series' era."""

    core_min: tuple[int, ...] | None = None
    core_max: tuple[int, ...] | None = None
    present: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    # (path, text) pairs: the file must / must not contain the text. For changes inside a file
    # that mark an era, such as the kernel that started zeroing fully masked rows.
    contains: tuple[tuple[str, str], ...] = ()
    lacks: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PatchFile:
    """One patch of a series: its file on disk and the hash recorded in ported trees.

    ``port`` is the folder under ``port/`` of a patch the series shares with others ('base' or a
    variant's name); ``shared`` the folder under ``shared/`` of one of its own patches that other
    series carry too; both None for a patch in the series' folder. ``name`` is the file name, but
    for a ``shared/`` patch the name ``git format-patch`` gives it in this series (its number is
    its place in the list), which is what reports and ported trees record."""

    name: str
    path: Path
    port: str | None = None
    shared: str | None = None

    @property
    def entry(self) -> str:
        """How the series list names it: the file name, or its path from the series folder."""
        if self.port:
            return f"../{PORT_DIR}/{self.port}/{self.path.name}"
        if self.shared:
            return f"../{SHARED_DIR}/{self.shared}/{self.path.name}"
        return self.name

    def text(self) -> str:
        return self.path.read_bytes().decode("utf-8", "surrogateescape")

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PortVariant:
    """Where the replacement package goes (its folder) and its era constants, for every series whose
    entry names the variant (``[[port]]`` in catalogue.toml).

    The series differ in the package only by these, so the catalogue stores the package once
    (``port/base/``) plus, per variant that differs from it, one small patch (``port/<name>/``)."""

    name: str
    directory: Path
    replacement: str
    fully_masked_rows: str
    transformer_engine_imports_guarded: bool


@dataclass(frozen=True)
class Series:
    """A versioned patch series for one upstream era."""

    name: str
    era: str
    summary: str
    directory: Path
    fully_masked_rows: str
    replacement: str | None
    # False where upstream's megatron/core imports TransformerEngine layers with no guard.
    transformer_engine_imports_guarded: bool
    optional: tuple[str, ...]
    tested: tuple[TestedRef, ...]
    recognise: Recognise
    patches: tuple[PatchFile, ...] = field(default=())
    # GitHub "owner/name" whose history the tested refs belong to (a fork's series name the fork).
    repository: str = UPSTREAM_REPOSITORY
    # The port variant ([[port]]) whose shared patches create the replacement package; None for a
    # series that carries the package in a patch of its own.
    port: str | None = None

    @property
    def is_upstream(self) -> bool:
        return self.repository == UPSTREAM_REPOSITORY

    @property
    def lines(self) -> tuple[str, ...]:
        """The lines its tested refs are on, in :data:`LINES` order."""
        return tuple(line for line in LINES if any(t.line == line for t in self.tested))

    @property
    def tested_range(self) -> str:
        """First and last tested ref, the way people talk about a range."""
        if not self.tested:
            return "untested"
        first, last = self.tested[0].label, self.tested[-1].label
        return first if first == last else f"{first} … {last}"


@dataclass(frozen=True)
class Fork:
    """A fork whose trees get their own series: ``[[fork]]`` in the catalogue.

    A tree is the fork's when any mark holds: (path, text) where the file contains the text, or
    (path, "") where the path exists. Only series whose ``repository`` is the fork's are candidates
    for its trees, and the fork's series are never candidates for other trees."""

    repository: str
    marks: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Catalogue:
    """All series of one patches directory, in catalogue order."""

    root: Path
    series: tuple[Series, ...]
    forks: tuple[Fork, ...] = ()
    ports: tuple[PortVariant, ...] = ()

    def get(self, name: str) -> Series:
        for series in self.series:
            if series.name == name:
                return series
        known = ", ".join(s.name for s in self.series)
        raise MegaportError(f"unknown series '{name}'; known series: {known} (see 'megaport series')")


def builtin_patches_dir() -> Path:
    """Where the series shipped with megaport live: inside the wheel, or at the repo root in a checkout."""
    packaged = Path(__file__).resolve().parent / "patches"
    if (packaged / CATALOGUE_FILE).is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "patches"


def patches_dir(option: str | os.PathLike | None = None) -> Path:
    """The catalogue to use: ``--patches``, else ``$MEGAPORT_PATCHES``, else the built-in one."""
    chosen = option or os.environ.get(PATCHES_ENV)
    return Path(chosen).expanduser().resolve() if chosen else builtin_patches_dir()


def load_catalogue(root: str | os.PathLike | None = None) -> Catalogue:
    """Read and check a catalogue, failing with one line on anything a user could get wrong."""
    directory = patches_dir(root)
    path, data = _read(directory)
    entries = data.get("series")
    if not isinstance(entries, list) or not entries:
        raise MegaportError(f"{path}: no [[series]] entries", exit_code=2)
    ports = _ports(directory, path, data.get("port", []))
    series = tuple(_series_from_entry(directory, path, entry, ports) for entry in entries)
    names = [s.name for s in series]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise MegaportError(f"{path}: series listed twice: {', '.join(duplicates)}", exit_code=2)
    return Catalogue(root=directory, series=series, forks=_forks(path, data.get("fork", [])), ports=ports)


def load_ports(root: str | os.PathLike | None = None) -> tuple[PortVariant, ...]:
    """The catalogue's [[port]] variants alone: what ``regenerate`` writes before any series
    list can name their files."""
    directory = patches_dir(root)
    path, data = _read(directory)
    return _ports(directory, path, data.get("port", []))


def _read(directory: Path) -> tuple[Path, dict]:
    path = directory / CATALOGUE_FILE
    if not path.is_file():
        raise MegaportError(
            f"no {CATALOGUE_FILE} in {directory}; point --patches (or {PATCHES_ENV}) at a series catalogue",
            exit_code=2,
        )
    try:
        return path, tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MegaportError(f"{path}: not valid TOML: {exc}", exit_code=2) from None


# The series entry keys a port variant sets for every series that takes it.
PORT_KEYS = ("fully_masked_rows", "transformer_engine_imports", "replacement")


def _ports(directory: Path, path: Path, entries) -> tuple[PortVariant, ...]:
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise MegaportError(f"{path}: [[port]] must be an array of tables", exit_code=2)
    ports = []
    for entry in entries:
        name = entry.get("name")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise MegaportError(f"{path}: [[port]] name {name!r} must be a plain folder name", exit_code=2)
        if not isinstance(entry.get("replacement"), str) or not entry["replacement"]:
            raise MegaportError(f"{path}: [[port]] {name} needs replacement (the port package's folder in the tree)", exit_code=2)
        if any(p.name == name for p in ports) or name == PORT_BASE:
            raise MegaportError(f"{path}: [[port]] {name} is listed twice (or is '{PORT_BASE}', the shared folder)",
                                exit_code=2)
        ports.append(PortVariant(
            name=name,
            directory=directory / PORT_DIR / name,
            replacement=entry["replacement"],
            fully_masked_rows=str(entry.get("fully_masked_rows", "zero")),
            transformer_engine_imports_guarded=entry.get("transformer_engine_imports", "guarded") != "unguarded",
        ))
    return tuple(ports)


def _forks(path: Path, entries) -> tuple[Fork, ...]:
    if not isinstance(entries, list):
        raise MegaportError(f"{path}: [[fork]] must be an array of tables", exit_code=2)
    forks = []
    for entry in entries:
        repository = _repository(path, "[[fork]]", entry.get("repository") if isinstance(entry, dict) else None)
        marks = _text_rules(path, entry.get("marks", ()))
        if not marks:
            raise MegaportError(f"{path}: [[fork]] {repository} needs marks (path and text)", exit_code=2)
        forks.append(Fork(repository=repository, marks=marks))
    return tuple(forks)


def _series_from_entry(directory: Path, path: Path, entry: dict, ports: tuple[PortVariant, ...] = ()) -> Series:
    try:
        name = str(entry["name"])
    except (KeyError, TypeError):
        raise MegaportError(f"{path}: a [[series]] entry has no name", exit_code=2) from None
    if "/" in name or name.startswith(".") or not name or name in COMMON_DIRS:
        raise MegaportError(f"{path}: series name '{name}' must be a plain folder name other than "
                            f"'{PORT_DIR}' or '{SHARED_DIR}'",
                            exit_code=2)
    folder = directory / name
    recognise = entry.get("recognise", {})
    version = recognise.get("core_version", {})
    port = _port_of(path, name, entry, ports)
    return Series(
        name=name,
        era=str(entry.get("era", "")),
        summary=str(entry.get("summary", "")),
        directory=folder,
        fully_masked_rows=port.fully_masked_rows if port else str(entry.get("fully_masked_rows", "zero")),
        replacement=port.replacement if port else entry.get("replacement"),
        transformer_engine_imports_guarded=(
            port.transformer_engine_imports_guarded if port
            else entry.get("transformer_engine_imports", "guarded") != "unguarded"
        ),
        optional=tuple(entry.get("optional", ())),
        tested=tuple(_tested_ref(path, name, t) for t in entry.get("tested", ())),
        recognise=Recognise(
            core_min=parse_version(version["min"]) if "min" in version else None,
            core_max=parse_version(version["max"]) if "max" in version else None,
            present=tuple(recognise.get("present", ())),
            absent=tuple(recognise.get("absent", ())),
            contains=_text_rules(path, recognise.get("contains", ())),
            lacks=_text_rules(path, recognise.get("lacks", ())),
        ),
        patches=_patch_files(folder, name, ports),
        repository=_repository(path, f"series '{name}'", entry.get("repository", UPSTREAM_REPOSITORY)),
        port=port.name if port else None,
    )


def _tested_ref(path: Path, name: str, entry: dict) -> TestedRef:
    ref = str(entry["ref"])
    line = str(entry.get("line") or line_of(ref))
    if line not in LINES:
        raise MegaportError(
            f"{path}: series '{name}': tested ref {ref}: line {line!r} is not one of {', '.join(LINES)}", exit_code=2
        )
    return TestedRef(ref=ref, sha=str(entry.get("sha", "")), date=entry.get("date"), line=line)


def _port_of(path: Path, name: str, entry: dict, ports: tuple[PortVariant, ...]) -> PortVariant | None:
    """The [[port]] a series entry names; its era fields then come from there, never the entry."""
    if "port" not in entry:
        return None
    wanted = entry["port"]
    port = next((p for p in ports if p.name == wanted), None)
    if port is None:
        known = ", ".join(p.name for p in ports) or "none"
        raise MegaportError(f"{path}: series '{name}': port {wanted!r} is not a [[port]] (known: {known})", exit_code=2)
    doubled = [key for key in PORT_KEYS if key in entry]
    if doubled:
        raise MegaportError(
            f"{path}: series '{name}': its port '{wanted}' sets {', '.join(doubled)}; remove that from the entry",
            exit_code=2,
        )
    return port


def _repository(path: Path, name: str, value) -> str:
    if not isinstance(value, str) or value.count("/") != 1 or not all(value.split("/")):
        raise MegaportError(f"{path}: {name}: repository {value!r} must be a GitHub 'owner/name'", exit_code=2)
    return value


def _text_rules(path: Path, entries) -> tuple[tuple[str, str], ...]:
    try:
        return tuple((str(e["path"]), str(e["text"])) for e in entries)
    except (KeyError, TypeError):
        raise MegaportError(f"{path}: contains/lacks entries need a path and a text", exit_code=2) from None


def list_entries(listing: Path) -> list[tuple[int, str]]:
    """(line number, entry) of a series list file: '#' starts a comment, blank lines are skipped."""
    entries = []
    for number, line in enumerate(listing.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append((number, entry))
    return entries


def common_entry(entry: str) -> tuple[str, str, str] | None:
    """(``port`` or ``shared``, folder, file name) for a list entry ``../port/<folder>/<file>`` or
    ``../shared/<folder>/<file>``, else None."""
    parts = entry.split("/")
    if len(parts) == 4 and parts[0] == ".." and parts[1] in COMMON_DIRS and all(_plain(p) for p in parts[2:]):
        return parts[1], parts[2], parts[3]
    return None


def port_entry(entry: str) -> tuple[str, str] | None:
    """(folder, file name) for a list entry ``../port/<folder>/<file>``, else None."""
    common = common_entry(entry)
    return common[1:] if common and common[0] == PORT_DIR else None


def _plain(part: str) -> bool:
    return bool(part) and not part.startswith(".")


def entry_patch(folder: Path, entry: str, place: int) -> PatchFile | None:
    """The patch the ``place``-th (from 1) list entry of the series in ``folder`` names (the file
    need not exist): a file in the folder, ``../port/<folder>/<file>`` or
    ``../shared/<folder>/<file>``; None for any other path. The one place a list entry becomes a
    file, so everything reading a list follows the relative paths alike."""
    common = common_entry(entry)
    if common:
        top, where, name = common
        path = folder.parent / top / where / name
        if top == PORT_DIR:
            return PatchFile(name=name, path=path, port=where)
        return PatchFile(name=_numbered(name, place), path=path, shared=where)
    if "/" in entry or entry.startswith("."):
        return None
    return PatchFile(name=entry, path=folder / entry)


def _numbered(name: str, place: int) -> str:
    """``0006-Subject.patch`` as the ``place``-th patch of a series: ``git format-patch``'s name there."""
    number, dash, rest = name.partition("-")
    return f"{place:04d}-{rest}" if dash and len(number) == 4 and number.isdigit() else name


def read_list(folder: Path) -> list[tuple[int, str, PatchFile | None]]:
    """(line number, entry, the patch it names or None when it names no allowed place) of each
    entry of the series list in ``folder``."""
    entries = list_entries(folder / LIST_FILE)
    return [(number, entry, entry_patch(folder, entry, place)) for place, (number, entry) in enumerate(entries, 1)]


def rewrite_list(text: str, entries: dict[str, str | None]) -> str:
    """A list file's text with each entry in ``entries`` renamed (None: its line dropped); comments,
    blank lines and order kept."""
    out = []
    for line in text.splitlines(keepends=True):
        entry = line.split("#", 1)[0].strip()
        if entry in entries:
            if entries[entry] is None:
                continue
            line = line.replace(entry, entries[entry], 1)
        out.append(line)
    return "".join(out)


def _patch_files(folder: Path, name: str, ports: tuple[PortVariant, ...] = ()) -> tuple[PatchFile, ...]:
    """The ordered patches named by the series list file: files in the folder, shared port patches
    (``../port/<folder>/<file>``, the folder 'base' or a [[port]]) and patches stored once for
    several series (``../shared/<folder>/<file>``); every one must exist."""
    listing = folder / LIST_FILE
    if not listing.is_file():
        raise MegaportError(f"series '{name}': missing list file {listing}", exit_code=2)
    patches = []
    for _, entry, patch in read_list(folder):
        if patch is None:
            raise MegaportError(
                f"series '{name}': list entry '{entry}' must be a file in {folder}, "
                f"../{PORT_DIR}/<folder>/<file> or ../{SHARED_DIR}/<folder>/<file>", exit_code=2)
        if patch.port and patch.port != PORT_BASE and not any(p.name == patch.port for p in ports):
            raise MegaportError(
                f"series '{name}': {LIST_FILE} names {entry}, but catalogue.toml has no [[port]] '{patch.port}'",
                exit_code=2)
        if not patch.path.is_file():
            hint = " (run 'megaport regenerate' to write the [[port]] patches)" if patch.port else ""
            raise MegaportError(f"series '{name}': {LIST_FILE} names {entry}, which does not exist{hint}", exit_code=2)
        if any(p.name == patch.name or p.path == patch.path for p in patches):
            raise MegaportError(f"series '{name}': {LIST_FILE} names {entry} twice", exit_code=2)
        patches.append(patch)
    if not patches:
        raise MegaportError(f"series '{name}': {listing} lists no patches", exit_code=2)
    return tuple(patches)


def parse_version(text: str) -> tuple[int, ...]:
    """'0.16.1' → (0, 16, 1); pre-release suffixes ('0.14.0rc3') compare as the release."""
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)
