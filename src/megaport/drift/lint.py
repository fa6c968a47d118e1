"""Static checks of a series catalogue, for CI: no upstream needed.

* every patch has a subject, a reason (a message body besides its trailers) and an
  ``Upstream-Range: <first>..<last>`` trailer naming the upstream refs it is for;
* ``catalogue.toml`` and the folders agree: each entry has its folder and list file, every
  listed patch exists (once), no ``.patch`` file is left out of a list, no folder is left out
  of the catalogue;
* each ``[[port]]`` variant is valid, distinct and taken by some series, ``port/`` holds exactly
  the shared patches megaport writes for them, and a series with ``port = "<variant>"`` lists
  that variant's shared patches first, in order (shared patches carry no range trailer);
* a patch is stored once: no two patches (series folders and ``shared/``) are the same but for
  their range trailers, and each file in ``shared/`` is listed by two series or more;
* no patch names a path outside the tree (``engine.check_patch_paths``) or creates a symlink;
* every entry's fields and ``[series.recognise]`` rules parse.

Each problem is one line: where, what is wrong, and what to do.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megaport.catalogue import (
    CATALOGUE_FILE, COMMON_DIRS, LIST_FILE, PATCHES_ENV, PORT_BASE, PORT_DIR, PORT_KEYS, SHARED_DIR, PortVariant,
    list_entries, read_list,
)
from megaport.engine import PatchFormatError, UnsafePathError, check_patch_paths, parse_patch
from megaport.engine.paths import unsafe_reason
from megaport.errors import MegaportError
from megaport.portpatches import port_patches
from megaport.regenerate import with_range_trailers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TRAILER = "Upstream-Range"
_TRAILER_LINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*:\s")
_RANGE = re.compile(rf"^{TRAILER}:\s*(\S+?)\.\.(\S+)\s*$", re.IGNORECASE)
_VERSION = re.compile(r"^\d+(\.\d+){0,2}([A-Za-z]+\d*)?$")
_SHA = re.compile(r"^([0-9a-f]{40}|[0-9a-f]{64})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_ENTRY_KEYS = {"name", "era", "summary", "fully_masked_rows", "transformer_engine_imports", "replacement", "optional",
               "tested", "recognise", "repository", "port"}
_PORT_KEYS = {"name", *PORT_KEYS}
_RECOGNISE_KEYS = {"core_version", "present", "absent", "contains", "lacks"}
_IGNORED_DIRS = {"__pycache__"}


@dataclass(frozen=True)
class Problem:
    """``path[:line]: what — what to do``."""

    path: Path
    message: str
    line: Optional[int] = None

    def where(self, cwd: Optional[Path] = None) -> str:
        base = (cwd or Path.cwd()).resolve()
        try:
            shown = self.path.resolve().relative_to(base).as_posix()
        except ValueError:
            shown = os.fspath(self.path)
        return f"{shown}:{self.line}" if self.line else shown

    def render(self, cwd: Optional[Path] = None) -> str:
        return f"{self.where(cwd)}: {self.message}"


def lint_catalogue(root: Path) -> list[Problem]:
    """Every problem of the catalogue at ``root``. Raises :class:`MegaportError` (exit 3) when
    ``root`` holds no catalogue at all."""
    path = root / CATALOGUE_FILE
    if not path.is_file():
        raise MegaportError(
            f"no {CATALOGUE_FILE} in {root}; point --patches (or {PATCHES_ENV}) at a series catalogue", exit_code=3
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return [Problem(path, f"not valid TOML ({exc}); fix the syntax")]
    problems: list[Problem] = []
    if data.get("format", 1) != 1:
        problems.append(Problem(path, f"format = {data.get('format')!r} is not one megaport reads; use format = 1"))
    entries = data.get("series")
    if not isinstance(entries, list) or not entries:
        return problems + [Problem(path, "no [[series]] entries; add one per series folder")]
    ports = _check_ports(root, data.get("port", []), problems)
    names: list[str] = []
    taken: set[str] = set()
    listers: dict[Path, list[str]] = {}
    for number, entry in enumerate(entries, 1):
        name = _check_entry(path, number, entry, problems, ports)
        if name is None:
            continue
        if name in names:
            problems.append(Problem(path, f"series '{name}' is listed twice; remove one entry"))
            continue
        names.append(name)
        taken.add(entry.get("port"))
        problems.extend(_check_folder(root, name, entry, ports, listers))
    problems.extend(Problem(path, f"[[port]] {name} is taken by no series; remove it") for name in ports if name not in taken)
    problems.extend(_check_port_folder(root, ports))
    problems.extend(_check_shared_folder(root, listers))
    problems.extend(_check_stored_once(root, listers))
    for child in sorted(root.iterdir()):
        if child.name in COMMON_DIRS and child.is_dir():
            continue
        if child.is_dir() and child.name not in names and not child.name.startswith((".", "_")) and child.name not in _IGNORED_DIRS:
            problems.append(Problem(child, f"folder is not in {CATALOGUE_FILE}; add a [[series]] entry named '{child.name}' or remove it"))
        elif child.is_file() and child.suffix == ".patch":
            problems.append(Problem(child, "patch outside any series folder; move it into one and list it, or remove it"))
    return problems


def _check_ports(root: Path, entries: Any, problems: list[Problem]) -> dict[str, PortVariant]:
    """The valid [[port]] variants by name; a problem for each one that is not."""
    path = root / CATALOGUE_FILE
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        problems.append(Problem(path, "[[port]] must be an array of tables"))
        return {}
    ports: dict[str, PortVariant] = {}
    for number, entry in enumerate(entries, 1):
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name == PORT_BASE:
            problems.append(Problem(path, f"[[port]] #{number}: name {name!r} must be a plain folder name other than '{PORT_BASE}'"))
            continue
        where = f"[[port]] {name}"
        found = len(problems)
        for key in sorted(set(entry) - _PORT_KEYS):
            problems.append(Problem(path, f"{where}: unknown key '{key}'; remove it or fix its spelling"))
        replacement = entry.get("replacement")
        if not isinstance(replacement, str) or not replacement or replacement.endswith((".py", "/")) \
                or unsafe_reason(replacement):
            problems.append(Problem(path, f"{where}: replacement {replacement!r} must be the port package's folder "
                                          "inside the tree (megatron/core/rocm_port)"))
        problems.extend(Problem(path, f"{where}: {m}") for m in _era_problems(entry))
        if name in ports:
            problems.append(Problem(path, f"{where} is listed twice; remove one"))
        if len(problems) > found:
            continue
        variant = PortVariant(name, root / PORT_DIR / name, replacement, entry.get("fully_masked_rows", "zero"),
                              entry.get("transformer_engine_imports", "guarded") != "unguarded")
        same = next((p for p in ports.values() if _settings(p) == _settings(variant)), None)
        if same:
            problems.append(Problem(path, f"{where} has the settings of [[port]] {same.name}; let their series share one"))
            continue
        ports[name] = variant
    return ports


def _settings(variant: PortVariant) -> tuple:
    return variant.replacement, variant.fully_masked_rows, variant.transformer_engine_imports_guarded


def _era_problems(entry: dict) -> list[str]:
    problems = []
    if entry.get("fully_masked_rows", "zero") not in ("zero", "uniform"):
        problems.append("fully_masked_rows must be \"zero\" or \"uniform\"")
    if entry.get("transformer_engine_imports", "guarded") not in ("guarded", "unguarded"):
        problems.append("transformer_engine_imports must be \"guarded\" or \"unguarded\"")
    return problems


def _check_entry(path: Path, number: int, entry: Any, problems: list[Problem],
                 ports: Optional[dict[str, PortVariant]] = None) -> Optional[str]:
    where = f"[[series]] #{number}"
    if not isinstance(entry, dict):
        problems.append(Problem(path, f"{where} is not a table"))
        return None
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or name in COMMON_DIRS:
        problems.append(Problem(path, f"{where}: name {name!r} must be a plain folder name other than "
                                      f"'{PORT_DIR}' or '{SHARED_DIR}'"))
        return None
    where = f"series '{name}'"
    for key in sorted(set(entry) - _ENTRY_KEYS):
        problems.append(Problem(path, f"{where}: unknown key '{key}'; remove it or fix its spelling"))
    problems.extend(Problem(path, f"{where}: {m}") for m in _era_problems(entry))
    if "port" in entry:
        if entry["port"] not in (ports or {}):
            known = ", ".join(ports or {}) or "none"
            problems.append(Problem(path, f"{where}: port {entry['port']!r} is not a valid [[port]] (known: {known})"))
        for key in PORT_KEYS:
            if key in entry:
                problems.append(Problem(path, f"{where}: {key} comes from its port '{entry['port']}'; remove it from the entry"))
    optional = entry.get("optional", [])
    if not _strings(optional):
        problems.append(Problem(path, f"{where}: optional must be a list of paths"))
    else:
        for item in optional:
            if unsafe_reason(item.rstrip("/")):
                problems.append(Problem(path, f"{where}: optional path {item!r} is not a path inside the tree"))
    repository = entry.get("repository", "NVIDIA/Megatron-LM")
    if not isinstance(repository, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repository):
        problems.append(Problem(path, f"{where}: repository {repository!r} must be a GitHub 'owner/name'"))
    tested = entry.get("tested", [])
    if not isinstance(tested, list):
        problems.append(Problem(path, f"{where}: tested must be a list of {{ ref = ..., sha = ... }}"))
    else:
        for item in tested:
            if not isinstance(item, dict) or not isinstance(item.get("ref"), str) or not item.get("ref"):
                problems.append(Problem(path, f"{where}: tested entry {item!r} needs a ref"))
            elif item.get("sha") and not _SHA.match(str(item["sha"])):
                problems.append(Problem(path, f"{where}: tested {item['ref']}: sha {item['sha']!r} is not a full commit id"))
    recognise = entry.get("recognise", {})
    if not isinstance(recognise, dict):
        problems.append(Problem(path, f"{where}: [series.recognise] must be a table"))
    else:
        problems.extend(Problem(path, f"{where}: recognise: {m}") for m in recognise_problems(recognise))
    return name


def recognise_problems(rules: dict) -> list[str]:
    """What is wrong with one ``[series.recognise]`` table (empty when it parses)."""
    problems = [f"unknown rule '{key}'; known: {', '.join(sorted(_RECOGNISE_KEYS))}" for key in sorted(set(rules) - _RECOGNISE_KEYS)]
    version = rules.get("core_version", {})
    if not isinstance(version, dict) or set(version) - {"min", "max"}:
        problems.append("core_version must be { min = \"X.Y.Z\", max = \"X.Y.Z\" }")
    else:
        parsed = {}
        for bound in ("min", "max"):
            if bound in version:
                if not isinstance(version[bound], str) or not _VERSION.match(version[bound]):
                    problems.append(f"core_version {bound} {version[bound]!r} is not a version like \"0.13.0\"")
                else:
                    parsed[bound] = tuple(int(re.match(r"\d+", p).group()) for p in version[bound].split(".")[:3])
        if len(parsed) == 2 and parsed["min"] >= parsed["max"]:
            problems.append("core_version min must be below max (the range is [min, max))")
    for key in ("present", "absent"):
        value = rules.get(key, [])
        if not _strings(value):
            problems.append(f"{key} must be a list of paths")
        else:
            problems.extend(f"{key} path {p!r} is not a path inside the tree" for p in value if unsafe_reason(p))
    for key in ("contains", "lacks"):
        value = rules.get(key, [])
        if not isinstance(value, list) or not all(
            isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("text"), str) and e["text"]
            for e in value
        ):
            problems.append(f"{key} must be a list of {{ path = \"...\", text = \"...\" }} with non-empty text")
    return problems


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v for v in value)


def _check_folder(root: Path, name: str, entry: dict, ports: Optional[dict[str, PortVariant]] = None,
                  listers: Optional[dict[Path, list[str]]] = None) -> list[Problem]:
    """The series' folder and list; ``listers`` gathers which series list each patch of theirs
    (not the port's)."""
    folder = root / name
    if not folder.is_dir():
        return [Problem(root / CATALOGUE_FILE, f"series '{name}' has no folder {name}/; create it or remove the entry")]
    listing = folder / LIST_FILE
    if not listing.is_file():
        return [Problem(folder, f"no '{LIST_FILE}' list file; list the patches in order, one per line")]
    problems = []
    listed: list[Path] = []
    shared: list[tuple[int, str]] = []
    listers = {} if listers is None else listers
    for number, item, patch in read_list(folder):
        if patch is None:
            problems.append(Problem(listing, f"'{item}' must be a file name in this folder, ../{PORT_DIR}/<folder>/<file> "
                                             f"or ../{SHARED_DIR}/<folder>/<file>", number))
        elif patch.port:
            if not patch.path.is_file():
                problems.append(Problem(listing, f"names {item}, which does not exist; fix the line or run 'megaport regenerate'", number))
            shared.append((number, item))
        elif patch.path in listed:
            problems.append(Problem(listing, f"'{item}' is listed twice; remove one line", number))
        elif not patch.path.is_file():
            problems.append(Problem(listing, f"names {item}, which does not exist; fix the name or remove the line", number))
        else:
            listed.append(patch.path)
            listers.setdefault(patch.path, []).append(name)
            if not patch.shared:
                problems.extend(lint_patch(patch.path, entry))
    problems.extend(_check_shared_lines(listing, entry, shared, ports or {}))
    if not listed and not shared and not problems:
        problems.append(Problem(listing, "lists no patches"))
    for stray in sorted(folder.glob("*.patch")):
        if stray not in listed:
            problems.append(Problem(stray, f"not in {name}/{LIST_FILE}; list it or remove it"))
    return problems


def _check_shared_folder(root: Path, listers: dict[Path, list[str]]) -> list[Problem]:
    """Each file in ``shared/`` is a valid patch that two series or more list."""
    folder = root / SHARED_DIR
    problems = []
    found = sorted(folder.glob("*/*")) if folder.is_dir() else []
    for path in found:
        if path.name.startswith(".") or path.parent.name in _IGNORED_DIRS:
            continue
        series = listers.get(path, [])
        if path.suffix != ".patch" or not series:
            problems.append(Problem(path, "listed by no series; remove it (or run 'megaport regenerate')"))
        elif len(series) == 1:
            problems.append(Problem(path, f"listed by {series[0]} alone; run 'megaport regenerate' to move it into {series[0]}/"))
        else:
            problems.extend(lint_patch(path))
    return problems


def _check_stored_once(root: Path, listers: dict[Path, list[str]]) -> list[Problem]:
    """No two listed patch files are the same patch but for their Upstream-Range trailers: such a
    patch is stored once, in ``shared/``, and each series lists it there."""
    first: dict[bytes, Path] = {}
    problems = []
    for path in listers:
        try:
            body = with_range_trailers(path.read_bytes(), [])
        except MegaportError:
            continue  # no diff: reported by lint_patch
        if body in first:
            other = first[body].relative_to(root).as_posix()
            problems.append(Problem(path, f"the same patch as {other} but for its '{TRAILER}'; run 'megaport regenerate' "
                                          f"to store it once in {SHARED_DIR}/"))
        else:
            first[body] = path
    return problems


def _check_shared_lines(listing: Path, entry: dict, shared: list[tuple[int, str]],
                        ports: dict[str, PortVariant]) -> list[Problem]:
    """A series with a port lists exactly its variant's shared patches, first; one without, none."""
    port = entry.get("port")
    if port is None:
        return [Problem(listing, f"names the shared {item} but its catalogue entry has no port; add port = \"<variant>\"", number)
                for number, item in shared]
    if port not in ports:
        return []  # reported with the entry
    wanted = [p.entry for p in port_patches(ports[port])]
    lines = list_entries(listing)
    if [item for _, item in lines[: len(wanted)]] != wanted or len(shared) != len(wanted):
        first = "; ".join(wanted)
        return [Problem(listing, f"must start with port {port}'s shared patches and name no others: {first}", 1)]
    return []


def _check_port_folder(root: Path, ports: dict[str, PortVariant]) -> list[Problem]:
    """``port/`` holds the shared patches megaport writes for the [[port]] variants, and nothing else."""
    wanted = {p.path(root): p for variant in ports.values() for p in port_patches(variant)}
    problems = [Problem(path, "missing; run 'megaport regenerate'") for path in wanted if not path.is_file()]
    folder = root / PORT_DIR
    if not folder.is_dir():
        return problems
    folders = {PORT_BASE, *ports}
    for child in sorted(folder.iterdir()):
        if child.name in _IGNORED_DIRS or child.name.startswith("."):
            continue
        if not child.is_dir() or child.name not in folders:
            problems.append(Problem(child, f"not a [[port]] variant's folder (nor '{PORT_BASE}'); remove it or add the [[port]]"))
            continue
        for patch in sorted(child.iterdir()):
            if patch not in wanted:
                problems.append(Problem(patch, "not a shared patch megaport writes for the [[port]] variants; remove it"))
            else:
                problems.extend(lint_patch(patch, shared=True))
    return problems


def lint_patch(path: Path, entry: Optional[dict] = None, *, shared: bool = False) -> list[Problem]:
    """Subject, reason, ``Upstream-Range`` trailer (none on a ``shared`` port patch), safe paths."""
    text = path.read_bytes().decode("utf-8", "surrogateescape")
    try:
        patch = parse_patch(text, name=path.name)
    except PatchFormatError as exc:
        return [Problem(path, f"cannot be parsed: {exc}; regenerate it with git format-patch")]
    problems = []
    subject_line = _line_of(text, r"^Subject:") or 1
    if not patch.subject:
        problems.append(Problem(path, "no subject; give the patch a one-line summary (Subject: ...)", subject_line))
    body, _ = split_trailers(patch.message)
    ranges = [line.strip() for line in patch.message.splitlines() if line.lower().startswith(TRAILER.lower() + ":")]
    if not "\n".join(line for line in body.splitlines() if line.strip() not in ranges).strip():
        problems.append(Problem(path, "no reason; say in the message body why the patch exists", subject_line))
    if shared:
        problems.extend(Problem(path, f"'{TRAILER}' on a shared port patch, whose series span eras; remove it",
                                _line_of(text, re.escape(trailer))) for trailer in ranges)
    elif not ranges:
        example = _example_range(entry)
        problems.append(
            Problem(path, f"no '{TRAILER}: <first>..<last>' trailer; add one at the end of the message (e.g. '{TRAILER}: {example}')",
                    subject_line)
        )
    else:
        for trailer in ranges:
            if not _RANGE.match(trailer):
                problems.append(Problem(path, f"'{trailer}' is not '{TRAILER}: <first>..<last>'; name the first and last upstream refs",
                                        _line_of(text, re.escape(trailer))))
    try:
        check_patch_paths(patch)
    except UnsafePathError as exc:
        problems.append(Problem(path, f"{exc}; keep every path inside the upstream tree"))
    for file in patch.files:
        if file.new_mode and file.new_mode.endswith("120000"):
            problems.append(Problem(path, f"creates symlink '{file.path}', which megaport refuses; ship a file instead", file.patch_line))
    return problems


def split_trailers(message: str) -> tuple[str, list[str]]:
    """The message without its trailer block, and the trailer lines (``Key: value``)."""
    paragraphs = message.strip().split("\n\n")
    last = [line for line in paragraphs[-1].splitlines() if line.strip()] if paragraphs else []
    if last and all(_TRAILER_LINE.match(line) for line in last):
        return "\n\n".join(paragraphs[:-1]), last
    return message, []


def _example_range(entry: Optional[dict]) -> str:
    tested = (entry or {}).get("tested") or []
    refs = [t.get("ref") for t in tested if isinstance(t, dict) and t.get("ref")]
    return f"{refs[0]}..{refs[-1]}" if refs else "core_v0.13.0..core_v0.16.1"


def _line_of(text: str, pattern: str) -> Optional[int]:
    match = re.search(pattern, text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else None
