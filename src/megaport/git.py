"""Every git command megaport runs, in one place (cache concerns live in :mod:`megaport.store`).

GitPython (:func:`open_repo`) answers where it costs no speed: first-parent lines
(:func:`first_parent`), ancestry (:func:`is_ancestor`) and the parsing of a fetch's progress
lines (:mod:`megaport.progress`). ``megaport apply`` must cost little more than ``git am``, and
on its path GitPython costs what apply cannot spare: importing it and opening a ``Repo`` (two
``git version`` runs) took 72-88 ms of CPU and 115-200 ms of wall time before the first object
was read, against 23-30 ms and 6-20 ms for a plain ``git cat-file --batch`` (both including
Python's own start, 22 ms of CPU; this 2-core machine, loaded, 8 runs each). So what apply uses
runs git directly, and each function whose output megaport parses by hand says why in its
docstring, with the figure: the object reader (:class:`ObjectReader`, commit
headers and tree entries included), ref listings (:func:`list_refs`), file listings
(:func:`ls_tree_paths`), rename detection (:func:`renamed_paths`), commits written by
:func:`fast_import`.

Every command goes through :func:`run_git` (or :class:`BackgroundGit`, :func:`stream_git`), which

* passes ``-c`` settings that keep file bytes exact (``core.autocrlf=false``,
  ``core.safecrlf=false``) so CRLF files survive checkouts and commits untouched;
* runs git with a cleaned environment: ``GIT_DIR``/``GIT_WORK_TREE``/``GIT_INDEX_FILE`` and
  the like (set when megaport runs from a git hook) are dropped, ``GIT_TERMINAL_PROMPT=0``
  so a missing or private https repository fails instead of waiting for a password, and
  ``LC_ALL=C`` so git's messages (which megaport quotes) are in English;
* turns a failure into :class:`GitError`, a :class:`~megaport.errors.MegaportError` whose
  one-line message carries git's own reason.

Paths passed to and returned from these helpers are ``str``; names git stores as bytes
that are not UTF-8 round-trip through ``surrogateescape``.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megaport.errors import MegaportError

if TYPE_CHECKING:  # GitPython is imported where it is used: `megaport --help` stays fast
    from git import Repo

__all__ = [
    "BYTE_EXACT_CONFIG",
    "BackgroundGit",
    "BlobReader",
    "GitError",
    "ObjectReader",
    "changed_files",
    "checkout_branch",
    "export_commit",
    "fast_import",
    "first_parent",
    "git_command",
    "git_env",
    "git_reason",
    "has_commit",
    "is_ancestor",
    "is_dirty",
    "is_shallow",
    "list_refs",
    "ls_tree_paths",
    "merge_file",
    "open_repo",
    "renamed_paths",
    "rev_parse",
    "run_git",
    "stream_git",
]

#: ``-c`` options passed to every git command: line endings stay byte-exact, no fsmonitor
#: daemon is started for throwaway work trees, and ``git gc --auto`` runs in the foreground
#: (inside megaport's store lock) instead of detaching into the background.
BYTE_EXACT_CONFIG: tuple[str, ...] = (
    "-c", "core.autocrlf=false",
    "-c", "core.safecrlf=false",
    "-c", "core.fsmonitor=false",
    "-c", "gc.autoDetach=false",
    "-c", "advice.detachedHead=false",
)  # fmt: skip

# Environment variables git reads that megaport keeps (pre-commit keeps the same set):
# everything else named GIT_* would point git at some other repository or index.
_KEPT_GIT_ENV = frozenset(
    {
        "GIT_EXEC_PATH",
        "GIT_SSH",
        "GIT_SSH_COMMAND",
        "GIT_SSL_CAINFO",
        "GIT_SSL_NO_VERIFY",
        "GIT_CONFIG_COUNT",
        "GIT_CONFIG_GLOBAL",
        "GIT_CONFIG_NOSYSTEM",
        "GIT_CONFIG_SYSTEM",
        "GIT_HTTP_PROXY_AUTHMETHOD",
        "GIT_ALLOW_PROTOCOL",
        "GIT_ASKPASS",
        "GIT_TRACE",
        "GIT_TRACE_PACKET",
        "GIT_CURL_VERBOSE",
    }
)

_HEX_SHA = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")

# Lines git prints after the real reason that say nothing about it.
_NOISE = (
    "please make sure you have the correct access rights",
    "and the repository exists.",
    "could not read from remote repository.",
)


class GitError(MegaportError):
    """A git command failed. ``str(err)`` is one line; the details stay on the object."""

    def __init__(
        self,
        message: str,
        *,
        args: Sequence[str] = (),
        returncode: int = 1,
        stderr: str = "",
        exit_code: int = 1,
    ) -> None:
        super().__init__(message, exit_code=exit_code)
        self.git_args = tuple(args)
        self.returncode = returncode
        self.stderr = stderr
        self.reason = git_reason(stderr)

    @classmethod
    def from_result(cls, args: Sequence[str], returncode: int, stderr: str) -> GitError:
        reason = git_reason(stderr) or f"exit status {returncode}"
        return cls(
            f"git {_subcommand(args)} failed: {reason}", args=args, returncode=returncode, stderr=stderr
        )


def _subcommand(args: Sequence[str]) -> str:
    """The git command ``args`` run: the first word that is neither an option nor a ``-c`` value."""
    words = iter(args)
    for word in words:
        if word == "-c":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return "git"


def git_reason(stderr: str) -> str:
    """The one line of git's stderr that says why it failed, without ``fatal:``/``error:``.

    Git often ends with boilerplate ("Could not read from remote repository. Please make
    sure ..."), so this prefers the first ``fatal:``/``error:`` line that is not such
    boilerplate, then any other meaningful line, then the last line.
    """
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", stderr or "") if ln.strip()]
    if not lines:
        return ""

    def strip(line: str) -> str:
        return re.sub(r"^(?:fatal|error|remote):\s*", "", line).strip()

    def noise(line: str) -> bool:
        return strip(line).lower().startswith(_NOISE)

    for line in lines:
        if line.startswith(("fatal:", "error:")) and not noise(line):
            return strip(line)
    useful = [ln for ln in lines if not noise(ln) and not ln.startswith("hint:")]
    return strip(useful[0] if useful else lines[-1])


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment megaport runs git with (see the module docstring)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_")
        or k in _KEPT_GIT_ENV
        or k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))
    }
    env["GIT_TERMINAL_PROMPT"] = "0"
    env["LC_ALL"] = "C"
    env.pop("LANGUAGE", None)
    if extra:
        env.update(extra)
    return env


def git_command(args: Sequence[str]) -> list[str]:
    """The full argv for ``git <args>`` with :data:`BYTE_EXACT_CONFIG` in front."""
    return ["git", *BYTE_EXACT_CONFIG, *(os.fspath(a) for a in args)]


def run_git(
    args: Sequence[str | os.PathLike[str]],
    cwd: str | os.PathLike[str] | None = None,
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    input: str | bytes | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``git <args>`` in ``cwd`` and capture its output.

    ``env`` adds to (and overrides) :func:`git_env`. With ``text=True`` (the default)
    stdout/stderr are ``str`` (UTF-8, undecodable bytes kept via ``surrogateescape``),
    otherwise ``bytes``; ``input`` must match. Raises :class:`GitError` when git exits
    non-zero and ``check`` is true, or when git itself is not installed.
    """
    argv = git_command([os.fspath(a) for a in args])
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=git_env(env),
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
            capture_output=True,
            text=text,
            encoding="utf-8" if text else None,
            errors="surrogateescape" if text else None,
        )
    except FileNotFoundError as exc:
        if cwd is not None and not Path(cwd).is_dir():
            raise GitError(f"directory not found: {cwd}") from exc
        raise GitError("git is not installed or not on PATH; install git and retry") from exc
    if check and proc.returncode != 0:
        stderr = proc.stderr if text else proc.stderr.decode("utf-8", "replace")
        raise GitError.from_result([os.fspath(a) for a in args], proc.returncode, stderr)
    return proc


class BackgroundGit:
    """A git command running while Python does other work (two cores beat one).

    ``wait()`` returns like :func:`run_git` and raises :class:`GitError` on failure; ``cancel()``
    stops it when the work it was started for is abandoned.
    """

    def __init__(self, args: Sequence[str | os.PathLike[str]], cwd: str | os.PathLike[str]) -> None:
        self.args = [os.fspath(a) for a in args]
        self.proc = subprocess.Popen(
            git_command(self.args), cwd=cwd, env=git_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def wait(self) -> None:
        _, stderr = self.proc.communicate()
        if self.proc.returncode != 0:
            raise GitError.from_result(self.args, self.proc.returncode, stderr.decode("utf-8", "replace"))

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stream_git(
    args: Sequence[str | os.PathLike[str]],
    cwd: str | os.PathLike[str] | None,
    on_line: Callable[[str], None],
    *,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Run ``git <args>`` and hand each line it prints on stderr to ``on_line`` as it comes (a
    fetch's ``--progress`` updates end in ``\\r``, so lines split on ``\\r`` and ``\\n``);
    ``(exit status, stdout)``. The caller decides what a failure means."""
    argv = git_command([os.fspath(a) for a in args])
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=git_env(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError as exc:
        raise GitError("git is not installed or not on PATH; install git and retry") from exc
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    # GitPython's own pump (handle_process_output) reads by \n only: a bar would move once a phase.
    pending = b""
    fd = proc.stderr.fileno()
    while chunk := os.read(fd, 65536):
        *lines, pending = re.split(rb"[\r\n]", pending + chunk)
        for raw in lines:
            if raw.strip():
                on_line(raw.decode("utf-8", "replace"))
    if pending.strip():
        on_line(pending.decode("utf-8", "replace"))
    proc.stderr.close()
    returncode = proc.wait()
    reader.join()
    return returncode, b"".join(out).decode("utf-8", "surrogateescape")


def rev_parse(repo: str | os.PathLike[str], rev: str) -> str | None:
    """The object id ``rev`` names in ``repo``, or None when it names nothing.

    ``rev`` is any revision expression (``v1.0^{commit}``, ``main``, an abbreviated sha),
    resolved by ``git rev-parse --verify``: GitPython's pure-Python ``Repo.rev_parse`` takes a
    full 40-hex id on trust, and its ``Repo.git.rev_parse`` runs this same process after the
    import apply cannot spare (module docstring). A revision starting with ``-`` is never taken
    as an option.
    """
    if not rev or rev.startswith("-"):
        return None
    proc = run_git(["rev-parse", "--verify", "--quiet", rev], repo, check=False)
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and _HEX_SHA.fullmatch(out) else None


def has_commit(repo: str | os.PathLike[str], sha: str) -> bool:
    """True when the commit ``sha`` (full or abbreviated) is present in ``repo``."""
    return rev_parse(repo, f"{sha}^{{commit}}") is not None


def is_ancestor(repo: str | os.PathLike[str], ancestor: str, descendant: str) -> bool:
    """True when ``ancestor`` is ``descendant`` or one of its ancestors (GitPython's
    ``Repo.is_ancestor``, i.e. ``git merge-base --is-ancestor``).

    Raises :class:`GitError` when either revision is unknown.
    """
    import git

    try:
        return open_repo(repo).is_ancestor(ancestor, descendant)
    except git.GitCommandError as exc:
        args = ["merge-base", "--is-ancestor", ancestor, descendant]
        raise GitError.from_result(args, exc.status, str(exc.stderr or "")) from None


def is_shallow(repo: str | os.PathLike[str]) -> bool:
    """True when ``repo`` (a bare repository or a work tree, from any folder in it) is a shallow
    clone. Raises :class:`GitError` when it is not a repository."""
    proc = run_git(["rev-parse", "--is-shallow-repository"], repo, check=False)
    if proc.returncode != 0:
        raise GitError(f"{repo} is not a git repository")
    return proc.stdout.strip() == "true"


def list_refs(
    repo: str | os.PathLike[str], patterns: Sequence[str], *, sort: str | None = None,
    config: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """``(full ref name, commit)`` of every ref matching ``patterns`` (``for-each-ref``'s: a
    full name, a prefix ending at a ``/``, or a glob) that names a commit, annotated tags peeled,
    in ``sort`` order (``version:refname``, ...; ``config`` adds ``-c`` settings such as
    ``versionsort.suffix``).

    Hand-parsed ``for-each-ref`` output (five words a line): one process answers for every ref.
    Upstream's 76 tags with their commits took 7 ms here, 65 ms through GitPython's ``Repo.tags``
    (it peels each annotated tag with an object lookup); apply's name lookup asks for a branch, a
    tag and the pin in one run instead of three ``rev-parse`` runs.
    """
    fields = "%(refname) %(objecttype) %(objectname) %(*objecttype) %(*objectname)"
    args = [*config, "for-each-ref", *([f"--sort={sort}"] if sort else []), f"--format={fields}", *patterns]
    found = []
    for line in run_git(args, repo).stdout.splitlines():
        name, kind, sha, peeled_kind, peeled = (line.split(" ") + ["", ""])[:5]
        if kind == "commit":
            found.append((name, sha))
        elif peeled_kind == "commit":  # an annotated tag
            found.append((name, peeled))
    return found


def first_parent(
    repo: str | os.PathLike[str], tip: str, *, exclude: str | None = None, count: int | None = None
) -> list[str]:
    """The commits on ``tip``'s first-parent line, newest first, at most ``count``, stopping
    before those ``exclude`` has (GitPython's ``Repo.iter_commits``: 59 ms for drift's 4,654
    commits since v2.0, against 66 ms for the same ``rev-list`` parsed by hand). Raises
    :class:`GitError` when a revision is unknown."""
    import git

    revs = [tip, *([f"^{exclude}"] if exclude else [])]
    try:
        return [c.hexsha for c in open_repo(repo).iter_commits(revs, first_parent=True, max_count=count)]
    except git.GitCommandError as exc:
        args = ["rev-list", "--first-parent", *revs]
        raise GitError.from_result(args, exc.status, str(exc.stderr or "")) from None


def renamed_paths(repo: str | os.PathLike[str], base: str, commit: str) -> dict[str, str | None]:
    """Files of ``base`` that ``commit`` no longer has at their path: old path -> new path (git's
    rename detection) or None (deleted).

    Hand-parsed ``diff --name-status -z`` (old status, paths): from v2.0 to core_v0.16.1 (114
    deletions and renames) it took 0.98 s, GitPython's ``Commit.diff(find_renames=True)`` 1.08-1.21 s
    for the same answer, parsing ``diff --raw`` into a ``Diff`` object per file; git's rename
    detection is most of both.
    """
    out = run_git(
        ["diff", "--no-ext-diff", "--name-status", "-z", "--find-renames", "--diff-filter=DR", base, commit],
        repo,
    ).stdout
    fields = out.split("\0")
    result: dict[str, str | None] = {}
    i = 0
    while i < len(fields) and fields[i]:
        if fields[i].startswith("R") and i + 2 < len(fields):
            result[fields[i + 1]] = fields[i + 2]
            i += 3
        else:
            result.setdefault(fields[i + 1], None)
            i += 2
    return result


def changed_files(worktree: str | os.PathLike[str], commit: str, paths: Sequence[str]) -> list[str]:
    """Which of ``paths`` differ between ``commit`` and the work tree (staged or not), sorted."""
    out = run_git(["diff", "--no-ext-diff", "--name-only", "-z", commit, "--", *paths], worktree).stdout
    return sorted(path for path in out.split("\0") if path)


def merge_file(current: bytes, base: bytes, other: bytes) -> tuple[bytes | None, int]:
    """``git merge-file``: the changes from ``base`` to ``other`` merged into ``current``.
    ``(merged, 0)`` when clean, ``(None, number of conflicts)`` otherwise."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megaport-merge-") as tmp:
        paths = []
        for name, data in (("current", current), ("base", base), ("other", other)):
            path = Path(tmp) / name
            path.write_bytes(data)
            paths.append(str(path))
        proc = run_git(["merge-file", "-p", "--quiet", *paths], tmp, check=False, text=False)
    if proc.returncode == 0:
        return proc.stdout, 0
    return None, max(proc.returncode, 1) if proc.returncode < 128 else 1


def fast_import(repo: str | os.PathLike[str], stream: bytes) -> dict[str, str]:
    """Run ``git fast-import`` on ``stream`` (commits, resets; ``mark :N`` where ids are wanted)
    in ``repo``; ``{":N": object id}`` of the marks it set.

    One process writes a whole series (31 ms for v2.6's six commits, loaded machine): GitPython
    has no stream import, and its ``Commit.create_from_tree`` wants a tree written through an
    index for every commit. The ids come back in an ``--export-marks`` file (``:N <id>`` a line),
    rather than from a ``rev-list`` run afterwards; ``fastimport.unpackLimit=0`` keeps the few
    objects of a port in one small pack instead of running ``git unpack-objects`` on them.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megaport-marks-") as tmp:
        marks = Path(tmp) / "marks"
        run_git(["-c", "fastimport.unpackLimit=0", "fast-import", "--quiet", "--done", f"--export-marks={marks}"],
                repo, input=stream + b"done\n", text=False)
        lines = marks.read_text(encoding="ascii").split("\n") if marks.exists() else []
    return dict(line.split(" ", 1) for line in lines if line)


def checkout_branch(worktree: str | os.PathLike[str], branch: str) -> None:
    """Switch ``worktree`` to the existing ``branch``: git writes only the files that differ from
    what is checked out, byte-exact, and refuses to overwrite local changes."""
    run_git(["checkout", "--quiet", branch, "--"], worktree)


def is_dirty(worktree: str | os.PathLike[str]) -> bool:
    """True when ``worktree`` has any tracked change (staged or not) or an untracked,
    non-ignored file. Line endings are compared byte-for-byte (``core.autocrlf=false``)."""
    proc = run_git(
        ["status", "--porcelain", "-z", "--untracked-files=normal", "--ignore-submodules=none"],
        worktree,
    )
    return bool(proc.stdout)


def ls_tree_paths(repo: str | os.PathLike[str], commit: str, prefix: str = "") -> list[str]:
    """Paths of all files (blobs, symlinks and submodule entries) in ``commit``, recursively.

    ``prefix`` limits the listing to a directory (``"megatron/core"``) or one file; it is a
    path, not a string prefix (``"megatron/co"`` matches nothing). Paths are relative to
    the repository root, in git's order.

    Hand-parsed ``ls-tree -z --name-only`` (NUL-separated paths): upstream main's 3,136 files took
    7 ms, GitPython's ``Tree.traverse()`` 197 ms (it reads every tree object in Python).
    """
    args = ["ls-tree", "-r", "-z", "--name-only", "--full-tree", commit]
    prefix = prefix.strip("/")
    if prefix:
        args += ["--", prefix]
    out = run_git(args, repo).stdout
    return [p for p in out.split("\0") if p]


def open_repo(repo: str | os.PathLike[str]) -> Repo:
    """A GitPython ``Repo`` that runs git with megaport's environment (see :func:`git_env`):
    no inherited ``GIT_DIR``/``GIT_INDEX_FILE`` points it elsewhere, prompts are off."""
    import git

    # GitPython's Repo() reads GIT_DIR, GIT_WORK_TREE, GIT_OBJECT_DIRECTORY and GIT_COMMON_DIR from
    # the process environment (set inside git hooks, for instance): hide them while it looks.
    wanted = git_env()
    hidden = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("GIT_") and k not in wanted}
    try:
        handle = git.Repo(os.fspath(repo), search_parent_directories=True)  # as git does
    except (git.NoSuchPathError, git.InvalidGitRepositoryError) as exc:
        raise GitError(f"{repo} is not a git repository") from exc
    finally:
        os.environ.update(hidden)
    # The git processes GitPython starts inherit the process environment, and it can only add to
    # it: what leaked in is pointed back at this repository (or emptied).
    own = {"GIT_DIR": handle.git_dir, "GIT_COMMON_DIR": handle.common_dir,
           "GIT_OBJECT_DIRECTORY": os.path.join(handle.common_dir, "objects")}
    if handle.working_tree_dir:
        own.update(GIT_WORK_TREE=handle.working_tree_dir, GIT_INDEX_FILE=os.path.join(handle.git_dir, "index"))
    overrides = {k: os.fspath(own.get(k, "")) for k in hidden}
    overrides.update(GIT_TERMINAL_PROMPT=wanted["GIT_TERMINAL_PROMPT"], LC_ALL=wanted["LC_ALL"])
    handle.git.update_environment(**overrides)
    return handle


class ObjectReader:
    """Any object of a repository, through one long-lived ``git cat-file --batch``.

    ``get("<sha>")`` or ``get("<commit>:<path>")`` gives ``(type, object id, content)``. Blobs and
    trees are cached by id, so a file or directory that did not change between two commits is
    read once: :meth:`entry` walks a commit's trees through that cache. On drift's proxy of
    upstream's history (``benchmarks/drift_history.py``, 4,382 commits) a path lookup per file
    asked git 558,268 times (44 s of 123 s); walking cached trees asks only for what changed. Not
    thread-safe: one per thread. :meth:`tree` gives per-commit views sharing the process.

    Hand-parsed: ``cat-file --batch`` answers ``<id> <type> <size>``, the content and a newline
    (or ``<name> missing``), and a tree object is ``<mode> <name>\\0<20-byte id>`` entries.
    GitPython's ``Repo.git.get_object_data`` speaks the same protocol, but apply reads
    upstream through this class and cannot spare GitPython's import (module docstring).
    """

    _TREE_MODE = 0o040000
    _GITLINK_MODE = 0o160000

    def __init__(self, repo: str | os.PathLike[str]) -> None:
        self.repo = Path(repo)
        self._blobs: dict[str, bytes] = {}
        self._absent: set[str] = set()
        self._trees: dict[str, dict[str, tuple[int, str]]] = {}
        self._roots: dict[str, tuple[str, str]] = {}
        self._times: dict[str, int] = {}
        if not self.repo.is_dir():
            raise GitError(f"{self.repo} is not a git repository")
        self._proc: subprocess.Popen | None = None
        self._closed = False

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the git process; the reader cannot be used afterwards."""
        proc, self._proc, self._closed = self._proc, None, True
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:  # the process is gone already
                    pass
            proc.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def process_id(self) -> int | None:
        """Pid of the ``git cat-file --batch`` serving this reader (started by the first read),
        or None before that."""
        return self._proc.pid if self._proc is not None else None

    def _process(self) -> subprocess.Popen:
        if self._proc is None:
            try:
                self._proc = subprocess.Popen(
                    git_command(["cat-file", "--batch"]), cwd=self.repo, env=git_env(),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                )
            except FileNotFoundError as exc:
                raise GitError("git is not installed or not on PATH; install git and retry") from exc
        return self._proc

    def get(self, name: str) -> tuple[str, str, bytes] | None:
        """``(type, object id, content)`` of the object ``name``, or None when there is none."""
        if self._closed:
            raise ValueError("ObjectReader is closed")
        if "\n" in name:
            raise ValueError(f"unsupported object name: {name!r}")
        proc = self._process()
        try:
            proc.stdin.write(name.encode("utf-8", "surrogateescape") + b"\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise OSError("no answer")
            header = line.decode("utf-8", "surrogateescape").split()
            if len(header) != 3 or not _HEX_SHA.fullmatch(header[0]) or not header[2].isdigit():
                return None  # "<name> missing" or "<name> ambiguous"
            oid, kind, size = header[0], header[1], int(header[2])
            data = proc.stdout.read(size + 1)[:size]
        except OSError as exc:  # the process died
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}") from exc
        if len(data) != size:
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}")
        if kind == "blob":
            self._blobs.setdefault(oid, data)
        return kind, oid, data

    def blob(self, oid: str | None) -> bytes | None:
        """The blob ``oid`` (full or abbreviated), or None when it is not in the repository.
        An absent blob is asked once (drift looks up every patch's preimage on every ref) until
        :meth:`objects_added`."""
        if not oid or set(oid) == {"0"} or oid in self._absent:
            return None
        if oid in self._blobs:
            return self._blobs[oid]
        found = self.get(oid)
        if found is None or found[0] != "blob":
            self._absent.add(oid)
            return None
        return found[2]

    def objects_added(self) -> None:
        """Something was fetched into the repository: blobs that were absent may be there now."""
        self._absent.clear()

    def commit(self, rev: str) -> tuple[str, str] | None:
        """``(commit id, root tree id)`` of the commit ``rev`` names (a sha, a ref, ``main~3``),
        or None when it names no commit. Asks git once per full sha.

        The ``tree`` and ``committer`` header lines are read by hand from the object this reader
        already has: a GitPython ``Commit`` would ask its own ``cat-file`` for it again."""
        if rev in self._roots:
            return self._roots[rev]
        found = self.get(f"{rev}^{{commit}}") if not rev.startswith("-") else None
        if found is None or found[0] != "commit" or not found[2].startswith(b"tree "):
            return None
        answer = found[1], found[2][5:45].decode("ascii")
        if _HEX_SHA.fullmatch(rev):  # names that can move are asked again next time
            self._roots[rev] = answer
        committer = re.search(rb"^committer .*> (\d+) [-+]\d{4}$", found[2].split(b"\n\n", 1)[0], re.M)
        self._times[answer[0]] = int(committer.group(1)) if committer else 0
        return answer

    def commit_time(self, rev: str) -> int | None:
        """When the commit ``rev`` names was committed (seconds since the epoch), or None."""
        found = self.commit(rev)
        return self._times[found[0]] if found is not None else None

    def entries(self, tree: str) -> dict[str, tuple[int, str]]:
        """``name -> (mode, object id)`` of the tree object ``tree``, in git's order; empty when
        there is no such tree."""
        if tree not in self._trees:
            found = self.get(tree)
            self._trees[tree] = _tree_entries(found[2]) if found is not None and found[0] == "tree" else {}
        return self._trees[tree]

    def entry(self, root: str, path: str) -> tuple[int, str] | None:
        """``(mode, object id)`` of ``path`` (``a/b/c``, ``""`` for the root) under the tree
        ``root``, or None when nothing is there."""
        found: tuple[int, str] | None = (self._TREE_MODE, root)
        for name in path.split("/") if path else ():
            if found is None or found[0] != self._TREE_MODE:
                return None
            found = self.entries(found[1]).get(name)
        return found

    def tree(self, commit: str) -> BlobReader:
        """The files of ``commit``, read through this reader's process."""
        return BlobReader(self.repo, commit, objects=self)


def _tree_entries(data: bytes) -> dict[str, tuple[int, str]]:
    """Parse a raw tree object: ``<octal mode> <name>\\0<20-byte id>`` per entry."""
    entries: dict[str, tuple[int, str]] = {}
    at, end = 0, len(data)
    while at < end:
        space = data.index(b" ", at)
        nul = data.index(b"\0", space)
        name = data[space + 1 : nul].decode("utf-8", "surrogateescape")
        entries[name] = (int(data[at:space], 8), data[nul + 1 : nul + 21].hex())
        at = nul + 21
    return entries


class BlobReader:
    """Read many files of one commit without a checkout.

    ::

        with BlobReader(cache_repo, sha) as tree:
            data = tree.read("megatron/core/__init__.py")   # bytes, or None when absent
            tree.exists("megatron/core")                      # files and directories
            tree.list_dir("megatron")                         # ['core', 'legacy', ...]

    Paths are relative to the repository root, ``/``-separated. It runs its own
    ``git cat-file --batch`` unless given an :class:`ObjectReader` to share (drift reads many
    commits through one). Raises :class:`GitError` when ``commit`` is not a commit in ``repo``.
    """

    def __init__(
        self, repo: str | os.PathLike[str], commit: str, *, objects: ObjectReader | None = None
    ) -> None:
        self.repo = Path(repo)
        self._owns = objects is None
        self.objects = objects if objects is not None else ObjectReader(self.repo)
        found = self.objects.commit(commit)
        if found is None:
            self.close()
            raise GitError(f"commit '{commit}' not found in {self.repo}")
        self.commit, self._root = found

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the git process when this reader started it."""
        if self._owns:
            self.objects.close()

    # -- queries ---------------------------------------------------------------------
    def read(self, path: str) -> bytes | None:
        """The exact bytes of the file at ``path`` (a symlink gives its target), or None
        when nothing is there or ``path`` is a directory."""
        return self.objects.blob(self.blob_id(path))

    def blob_id(self, path: str) -> str | None:
        """The blob id of the file at ``path``, or None."""
        found = self._entry(path)
        if found is None or found[0] in (ObjectReader._TREE_MODE, ObjectReader._GITLINK_MODE):
            return None
        return found[1]

    def mode(self, path: str) -> str | None:
        """git's mode of ``path`` as ``ls-tree`` prints it (``100644``, ``100755``, ``120000`` for
        a symbolic link, ``040000``, ``160000``), or None when nothing is there."""
        found = self._entry(path)
        return f"{found[0]:06o}" if found is not None else None

    def exists(self, path: str) -> bool:
        """True when ``path`` is a file, a directory or a submodule entry in the commit."""
        return self._entry(path) is not None

    def is_dir(self, path: str) -> bool:
        """True when ``path`` is a directory in the commit (``""`` is the root)."""
        found = self._entry(path)
        return found is not None and found[0] == ObjectReader._TREE_MODE

    def list_dir(self, path: str = "") -> list[str] | None:
        """Names of the entries directly inside directory ``path`` (``""`` is the root), in
        git's order; None when ``path`` is not a directory."""
        found = self._entry(path)
        if found is None or found[0] != ObjectReader._TREE_MODE:
            return None
        return list(self.objects.entries(found[1]))

    # -- internals -------------------------------------------------------------------
    def _entry(self, path: str) -> tuple[int, str] | None:
        if self.objects.closed:
            raise ValueError("BlobReader is closed")
        return self.objects.entry(self._root, self._clean(path))

    @staticmethod
    def _clean(path: str) -> str:
        path = os.fspath(path)
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if "\n" in path or ".." in parts:
            raise ValueError(f"unsupported path: {path!r}")
        return "/".join(parts)


def export_commit(repo: str | os.PathLike[str], commit: str, dest: str | os.PathLike[str]) -> None:
    """Write ``commit``'s files into the folder ``dest`` (no .git): ``git archive`` unpacked by
    tarfile's data filter, so no entry can land outside ``dest``. Used for the unported upstream
    a ported tree came from, without touching the tree or its index."""
    import io
    import tarfile

    archive = run_git(["archive", "--format=tar", commit], repo, text=False).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
