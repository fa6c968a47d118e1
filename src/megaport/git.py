"""The few git helpers megaport needs; nothing else in megaport shells out to git.

Every call goes through :func:`run_git`, which

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
from typing import IO

from megaport.errors import MegaportError

__all__ = [
    "BYTE_EXACT_CONFIG",
    "BlobReader",
    "GitError",
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

    ``rev`` is any revision expression (``v1.0^{commit}``, ``main``, an abbreviated sha);
    a revision starting with ``-`` is never taken as an option.
    """
    if not rev or rev.startswith("-"):
        return None
    proc = run_git(["rev-parse", "--verify", "--quiet", rev], repo, check=False)
    if proc.returncode != 0:
        return None
    out = proc.stdout.strip()
    return out if _HEX_SHA.fullmatch(out) else None


def has_commit(repo: str | os.PathLike[str], sha: str) -> bool:
    """True when the commit ``sha`` (full or abbreviated) is present in ``repo``."""
    return rev_parse(repo, f"{sha}^{{commit}}") is not None


def is_ancestor(repo: str | os.PathLike[str], ancestor: str, descendant: str) -> bool:
    """True when ``ancestor`` is ``descendant`` or one of its ancestors.

    Raises :class:`GitError` when either revision is unknown.
    """
    args = ["merge-base", "--is-ancestor", ancestor, descendant]
    proc = run_git(args, repo, check=False)
    if proc.returncode == 0:
        return True
    if proc.returncode == 1:
        return False
    raise GitError.from_result(args, proc.returncode, proc.stderr)


def is_shallow(repo: str | os.PathLike[str]) -> bool:
    """True when ``repo`` (a bare repository or a work tree) is a shallow clone."""
    out = run_git(["rev-parse", "--git-dir"], repo).stdout.strip()
    return (Path(repo) / out / "shallow").exists()


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


class ObjectReader:
    """Any object of a repository, through one long-lived ``git cat-file --batch``.

    ``get("<sha>")`` or ``get("<commit>:<path>")`` gives ``(type, object id, content)``. Blobs are
    cached by id, so a file that did not change between two commits is read once. Not
    thread-safe: one per thread. :meth:`tree` gives per-commit views sharing the process.
    """

    def __init__(self, repo: str | os.PathLike[str]) -> None:
        self.repo = Path(repo)
        self._blobs: dict[str, bytes] = {}
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            git_command(["cat-file", "--batch"]),
            cwd=self.repo,
            env=git_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort if close() was forgotten
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Stop the git process; the reader cannot be used afterwards."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()

    @property
    def closed(self) -> bool:
        return self._proc is None

    def get(self, name: str) -> tuple[str, str, bytes] | None:
        """``(type, object id, content)`` of the object ``name``, or None when there is none."""
        proc = self._proc
        if proc is None:
            raise ValueError("ObjectReader is closed")
        assert proc.stdin is not None and proc.stdout is not None
        if "\n" in name:
            raise ValueError(f"unsupported object name: {name!r}")
        try:
            proc.stdin.write(name.encode("utf-8", "surrogateescape") + b"\n")
            proc.stdin.flush()
            header = proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}") from exc
        if not header:
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}")
        line = header.rstrip(b"\n")
        if line.endswith((b" missing", b" ambiguous")):
            return None
        fields = line.split(b" ")
        if len(fields) != 3 or not fields[2].isdigit():
            self.close()
            raise GitError(f"unexpected reply from git cat-file: {header!r}")
        data = _read_exact(proc.stdout, int(fields[2]) + 1)[:-1]  # content, then a newline
        oid = fields[0].decode("ascii")
        if fields[1] == b"blob":
            self._blobs.setdefault(oid, data)
        return fields[1].decode("ascii"), oid, data

    def blob(self, oid: str | None) -> bytes | None:
        """The blob ``oid`` (full or abbreviated), or None when it is not in the repository."""
        if not oid or set(oid) == {"0"}:
            return None
        if oid in self._blobs:
            return self._blobs[oid]
        found = self.get(oid)
        return found[2] if found is not None and found[0] == "blob" else None

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
        sha = rev_parse(self.repo, f"{commit}^{{commit}}")
        if sha is None:
            raise GitError(f"commit '{commit}' not found in {self.repo}")
        self.commit = sha
        self._owns = objects is None
        self.objects = objects if objects is not None else ObjectReader(self.repo)
        self._entries: dict[str, tuple[str, str, bytes] | None] = {}

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
        obj = self._get(path)
        return obj[2] if obj is not None and obj[0] == "blob" else None

    def blob_id(self, path: str) -> str | None:
        """The blob id of the file at ``path``, or None."""
        obj = self._get(path)
        return obj[1] if obj is not None and obj[0] == "blob" else None

    def exists(self, path: str) -> bool:
        """True when ``path`` is a file, a directory or a submodule entry in the commit."""
        if not self._clean(path):
            return True  # the root directory
        return self._get(path) is not None or self._is_gitlink(path)

    def is_dir(self, path: str) -> bool:
        """True when ``path`` is a directory in the commit (``""`` is the root)."""
        obj = self._get(path)
        return obj is not None and obj[0] == "tree"

    def list_dir(self, path: str = "") -> list[str] | None:
        """Names of the entries directly inside directory ``path`` (``""`` is the root), in
        git's order; None when ``path`` is not a directory."""
        obj = self._get(path)
        if obj is None or obj[0] != "tree":
            return None
        return [name for _mode, name, _sha in self._parse_tree(obj[2])]

    # -- internals -------------------------------------------------------------------
    @staticmethod
    def _clean(path: str) -> str:
        path = os.fspath(path)
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if "\n" in path or ".." in parts:
            raise ValueError(f"unsupported path: {path!r}")
        return "/".join(parts)

    def _is_gitlink(self, path: str) -> bool:
        parent, _, name = self._clean(path).rpartition("/")
        obj = self._get(parent)
        if obj is None or obj[0] != "tree":
            return False
        return any(
            mode == "160000" and entry == name for mode, entry, _ in self._parse_tree(obj[2])
        )

    def _get(self, path: str) -> tuple[str, str, bytes] | None:
        if self.objects.closed:
            raise ValueError("BlobReader is closed")
        clean = self._clean(path)
        if clean not in self._entries:
            self._entries[clean] = self.objects.get(f"{self.commit}:{clean}")
        return self._entries[clean]

    def _parse_tree(self, data: bytes) -> list[tuple[str, str, str]]:
        """Entries of a raw tree object: ``(mode, name, hex id)``."""
        entries = []
        pos, n = 0, len(data)
        hash_len = len(self.commit) // 2  # 20 bytes for SHA-1, 32 for SHA-256
        while pos < n:
            space = data.index(b" ", pos)
            nul = data.index(b"\0", space)
            mode = data[pos:space].decode("ascii")
            name = data[space + 1 : nul].decode("utf-8", "surrogateescape")
            oid = data[nul + 1 : nul + 1 + hash_len].hex()
            entries.append((mode, name, oid))
            pos = nul + 1 + hash_len
        return entries


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise GitError("git cat-file stopped in the middle of an object")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)

