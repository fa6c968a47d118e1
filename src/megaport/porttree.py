"""The ported tree on disk: writing a successful plan as commits, and the state ``status`` reads.

The upstream commit is checked out into a temporary directory beside DEST in the background
while megaport plans the series (git writes files while Python computes). A successful plan is
then committed in one ``git fast-import`` run (one commit per patch on ``megaport/<series>``), git
switches the checkout to that branch (writing only the few changed files), and the directory is
renamed into place: a failure at any step leaves no DEST behind. The tree records the upstream commit, the
series and each patch's hash in ``.git/megaport/state.json`` (and ``refs/megaport/upstream``), so
``status`` needs no network and no catalogue.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megaport import __version__
from megaport.errors import MegaportError
from megaport.git import BackgroundGit, BlobReader, checkout_branch, fast_import, is_dirty, rev_parse

if TYPE_CHECKING:  # the engine loads while the background checkout runs, not before it starts
    from megaport.plan import SeriesPlan

STATE_FILE = Path("megaport") / "state.json"
COMMITTER = "megaport <megaport@localhost>"
SYMLINK_MODE = "120000"


@dataclass
class PatchRecord:
    name: str
    sha256: str
    status: str
    commit: str | None = None


@dataclass
class PortState:
    """What a ported tree remembers about how it was made."""

    upstream_url: str
    upstream_ref: str
    upstream_sha: str
    series: str
    branch: str
    head: str
    patches: list[PatchRecord]
    files: list[str]
    megaport_version: str = __version__
    format: int = 1
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PortState:
        data = json.loads(text)
        data["patches"] = [PatchRecord(**p) for p in data.get("patches", [])]
        return cls(**data)


def branch_name(series: str) -> str:
    return f"megaport/{series}"


def git_dir(tree: Path) -> Path | None:
    """The .git directory of a work tree root, or None when ``tree`` is not one."""
    candidate = tree / ".git"
    return candidate if candidate.is_dir() else None


def read_state(tree: Path) -> PortState | None:
    """The recorded state of a ported tree; None for any tree megaport did not make."""
    gitdir = git_dir(tree)
    if gitdir is None or not (gitdir / STATE_FILE).is_file():
        return None
    try:
        return PortState.from_json((gitdir / STATE_FILE).read_text(encoding="utf-8"))
    except (ValueError, TypeError) as exc:
        raise MegaportError(f"{gitdir / STATE_FILE} is damaged ({exc}); re-run apply into a new --dest") from None


def check_symlink_escape(tree: BlobReader, paths: list[str]) -> None:
    """Refuse a series that would write through a symbolic link in the upstream tree.

    git itself never writes beyond a link, but a user must hear it as a refusal before anything is
    written, not as a half-made tree.
    """
    prefixes = sorted({str(Path(*Path(p).parts[: i + 1])) for p in paths for i in range(len(Path(p).parts))})
    for path in prefixes:
        if tree.mode(path) == SYMLINK_MODE:
            raise MegaportError(
                f"refusing series: it writes through '{path}', a symbolic link in the upstream tree"
            )


def file_modes(tree: BlobReader, paths: list[str]) -> dict[str, str]:
    """Modes of existing files, so a patched script keeps its executable bit."""
    return {path: mode for path in paths if (mode := tree.mode(path)) is not None}


def fast_import_stream(plan: SeriesPlan, parent: str, branch: str, modes: dict[str, str]) -> bytes:
    """The fast-import input that makes one commit per changed patch, in series order, marked
    ``:1``, ``:2``...; with no changed patch the branch is the upstream commit itself."""
    out = bytearray(f"reset refs/heads/{branch}\nfrom {parent}\n\n".encode())
    by_name = {p.name: p for p in plan.parsed}
    mark = 0
    for patch_plan in plan.patches:
        if patch_plan.result is None or not patch_plan.result.changes:
            continue
        patch = by_name[patch_plan.name]
        when = _timestamp(patch.date)
        author = patch.author or COMMITTER
        message = (patch.subject + ("\n\n" + patch.message.strip() if patch.message.strip() else "") + "\n").encode()
        mark += 1
        out += f"commit refs/heads/{branch}\nmark :{mark}\n".encode()
        out += f"author {author} {when} +0000\ncommitter {COMMITTER} {when} +0000\n".encode()
        out += b"data %d\n" % len(message) + message
        for path, content in sorted(patch_plan.result.changes.items()):
            if content is None:
                out += b"D " + _quote(path) + b"\n"
            else:
                mode = modes.get(path, "100644")
                out += b"M " + mode.encode() + b" inline " + _quote(path) + b"\n"
                out += b"data %d\n" % len(content) + content + b"\n"
        out += b"\n"
    return bytes(out)


def _timestamp(date: str | None) -> int:
    """Author date of a patch as a Unix time; fixed dates make the ported commits reproducible.

    format-patch writes RFC 2822 dates in English (``Tue, 1 Nov 2022 10:00:00 +0100``), which
    ``datetime`` reads; ``email.utils`` (its imports cost apply's start-up ~5 ms) reads the rest.
    """
    if not date:
        return 0
    from datetime import datetime

    try:
        return int(datetime.strptime(date.strip(), "%a, %d %b %Y %H:%M:%S %z").timestamp())
    except ValueError:
        pass
    import email.utils

    try:
        return int(email.utils.parsedate_to_datetime(date).timestamp())
    except (TypeError, ValueError):
        return 0


def _quote(path: str) -> bytes:
    """fast-import path quoting (C style) for the rare path with spaces, quotes or newlines."""
    raw = path.encode("utf-8", "surrogateescape")
    if not any(c in raw for c in b' "\n\\') and not raw.startswith(b'"'):
        return raw
    escaped = raw.replace(b"\\", b"\\\\").replace(b'"', b'\\"').replace(b"\n", b"\\n")
    return b'"' + escaped + b'"'


def commit_plan(repo: Path, plan: SeriesPlan, parent: str, branch: str, modes: dict[str, str]) -> list[str]:
    """Write the plan's commits with one fast-import run; return the commit of each changed patch."""
    marks = fast_import(repo, fast_import_stream(plan, parent, branch, modes))
    return [marks[f":{n}"] for n in range(1, len(marks) + 1)]


@dataclass
class Staging:
    """A temporary tree beside DEST with the upstream checkout under way."""

    tmp: Path
    checkout: BackgroundGit

    def discard(self) -> None:
        self.checkout.cancel()
        remove_tree(self.tmp)


def start_staging(store, resolved, dest: Path) -> Staging:
    """Begin checking out upstream beside DEST; planning runs meanwhile."""
    tmp = temporary_sibling(dest)
    try:
        store.init_from_cache(resolved, tmp)
        # checkout.workers=0: one writer per core; a Megatron checkout is thousands of small files.
        checkout = ["-c", "checkout.workers=0", "checkout", "--quiet", "--detach", resolved.sha]
        return Staging(tmp, BackgroundGit(checkout, tmp))
    except BaseException:
        remove_tree(tmp)
        raise


def switch_to_series(tree: Path, branch: str) -> None:
    """Move the finished upstream checkout onto the series branch: git writes the files the
    series changed (with their modes) and points HEAD at the branch."""
    _index_after_checkout(tree)
    checkout_branch(tree, branch)


def _index_after_checkout(tree: Path) -> None:
    """Date the checkout's index a second after its files, so the next index write skips git's
    racy-clean re-hash of all of them.

    Git re-reads every file whose mtime is not older than the index (it cannot tell a same-second
    edit from the checkout itself). Nothing touched this private tree since the checkout, and the
    files the switch to the series branch writes get fresh stat data in the index it writes, which
    carries the real time again for every later git command.
    """
    index = tree / ".git" / "index"
    newest = max(index.stat().st_mtime, time.time()) + 1
    os.utime(index, (newest, newest))


def temporary_sibling(dest: Path) -> Path:
    """A fresh directory name next to DEST, so the final rename never crosses file systems."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.megaport-", dir=dest.parent))


def write_state(tree: Path, state: PortState) -> None:
    path = tree / ".git" / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(state.to_json(), encoding="utf-8")


def move_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished tree to DEST; DEST may be an empty directory the user made."""
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    os.rename(tmp, dest)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def tree_summary(tree: Path) -> tuple[str | None, bool]:
    """HEAD commit and whether the work tree has changes."""
    return rev_parse(tree, "HEAD"), is_dirty(tree)


def ported_tree(tree: Path) -> tuple[Path, PortState]:
    """The tree and its recorded state, or a usage error (exit 2)."""
    tree = tree.expanduser().absolute()
    if not tree.is_dir():
        raise MegaportError(f"{tree} is not a directory; give the ported tree (megaport apply --dest)", exit_code=2)
    state = read_state(tree)
    if state is None:
        raise MegaportError(
            f"{tree} is not a ported tree (no .git/megaport/state.json); run 'megaport apply' first", exit_code=2)
    return tree, state


def subprocess_env(tree: Path) -> dict:
    from megaport.envpaths import with_paths_first

    env = with_paths_first(None, tree)
    # Only the plugins the suite asks for: third-party pytest plugins installed on the machine
    # (random order, xdist, timeouts...) stay out of the run.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # Never write __pycache__ into the tree (it would show up in git status): cache it in
    # megaport's home instead, unless bytecode writing is off anyway.
    if not env.get("PYTHONDONTWRITEBYTECODE") and not env.get("PYTHONPYCACHEPREFIX"):
        from megaport.store import default_home

        env["PYTHONPYCACHEPREFIX"] = str(default_home() / "pycache")
    # A Megatron-DeepSpeed tree takes the code paths of DeepSpeed's GPU accelerator, as on ROCm.
    from megaport.deepspeed_fork import accelerator_env

    return accelerator_env(tree, env)
