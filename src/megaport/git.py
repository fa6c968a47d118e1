"""The few git helpers megaport needs; nothing else in megaport shells out to git.

Objects, refs and ancestry go through GitPython (:func:`open_repo`): its long-lived
``git cat-file --batch`` reads blobs and trees without a checkout (:class:`ObjectReader`,
:class:`BlobReader`), its tree parser lists directories, and ``Repo.git`` resolves revisions and
ancestry. What GitPython does not do the way megaport needs stays here, each saying why:
porcelain commands with byte-exact settings and git's own error text (:func:`run_git`),
a background checkout (:class:`BackgroundGit`), the dirty check with ``core.autocrlf=false``.

Every command megaport runs itself goes through :func:`run_git`, which

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megaport.errors import MegaportError

if TYPE_CHECKING:  # GitPython is imported where it is used: `megaport --help` stays fast
    from git import Repo

__all__ = [
    "BYTE_EXACT_CONFIG",
    "BlobReader",
    "GitError",
    "ObjectReader",
    "open_repo",
    "git_command",
    "git_env",
    "git_reason",
    "has_commit",
    "is_ancestor",
    "is_dirty",
    "is_shallow",
    "ls_tree_paths",
    "rev_parse",
    "run_git",
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
        sub = next((a for a in args if not a.startswith("-")), "git")
        reason = git_reason(stderr) or f"exit status {returncode}"
        return cls(
            f"git {sub} failed: {reason}", args=args, returncode=returncode, stderr=stderr
        )


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


def rev_parse(repo: str | os.PathLike[str], rev: str) -> str | None:
    """The object id ``rev`` names in ``repo``, or None when it names nothing.

    ``rev`` is any revision expression (``v1.0^{commit}``, ``main``, an abbreviated sha),
    resolved by git itself through GitPython (``git rev-parse --verify``): GitPython's own
    pure-Python ``Repo.rev_parse`` takes a full 40-hex id on trust, without looking it up. A
    revision starting with ``-`` is never taken as an option.
    """
    if not rev or rev.startswith("-"):
        return None
    import git

    try:
        out = open_repo(repo).git.rev_parse("--verify", "--quiet", rev).strip()
    except git.GitCommandError:
        return None
    return out if _HEX_SHA.fullmatch(out) else None


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
    """True when ``repo`` (a bare repository or a work tree) is a shallow clone."""
    return (Path(open_repo(repo).git_dir) / "shallow").exists()


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
    """Any object of a repository, through GitPython's long-lived ``git cat-file --batch``
    (``Repo.git.get_object_data``).

    ``get("<sha>")`` or ``get("<commit>:<path>")`` gives ``(type, object id, content)``. Blobs and
    trees are cached by id, so a file or directory that did not change between two commits is
    read once: :meth:`entry` walks a commit's trees through that cache. On drift's proxy of
    upstream's history (``benchmarks/drift_history.py``, 4,382 commits) a path lookup per file
    asked git 558,268 times (44 s of 123 s); walking cached trees asks only for what changed. Not
    thread-safe: one per thread. :meth:`tree` gives per-commit views sharing the process.
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
        self._git = open_repo(self.repo)

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the git process; the reader cannot be used afterwards."""
        handle, self._git = self._git, None
        if handle is not None:
            handle.close()

    @property
    def closed(self) -> bool:
        return self._git is None

    @property
    def process_id(self) -> int | None:
        """Pid of the ``git cat-file --batch`` serving this reader (GitPython keeps it as
        ``Git.cat_file_all`` once the first object is read), or None before that."""
        proc = getattr(self._git.git, "cat_file_all", None) if self._git is not None else None
        return getattr(proc, "pid", None)

    def get(self, name: str) -> tuple[str, str, bytes] | None:
        """``(type, object id, content)`` of the object ``name``, or None when there is none."""
        if self._git is None:
            raise ValueError("ObjectReader is closed")
        if "\n" in name:
            raise ValueError(f"unsupported object name: {name!r}")
        try:
            oid, kind, _size, data = self._git.git.get_object_data(name)
        except ValueError:  # git cat-file answered "missing" or "ambiguous"
            return None
        except (OSError, AttributeError) as exc:  # the process died (AttributeError: no stdout)
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}") from exc
        oid, kind = oid.decode("ascii"), kind.decode("ascii")  # GitPython gives the header as bytes
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
        or None when it names no commit. Asks git once per full sha."""
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
        """``name -> (mode, object id)`` of the tree object ``tree``, in git's order (parsed by
        GitPython); empty when there is no such tree."""
        if tree not in self._trees:
            found = self.get(tree)
            parsed = {}
            if found is not None and found[0] == "tree":
                from git.objects.fun import tree_entries_from_data

                parsed = {name: (mode, binsha.hex()) for binsha, mode, name in tree_entries_from_data(found[2])}
            self._trees[tree] = parsed
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
