"""Build throwaway git repositories for tests, with stable shas.

Import from a test module as ``from support.gitrepos import make_repo, commit``: pytest puts
``tests/`` on ``sys.path`` (it has no ``__init__.py``), so ``support`` is importable.

Everything here runs plain ``git`` (not megaport's helpers, which are under test) with a
fixed author/committer and date and with the user's global/system git configuration
ignored, so the same calls give the same shas on every machine. File contents are written
byte-for-byte (``str`` is encoded as UTF-8, nothing else is translated; CRLF stays CRLF)
and ``core.autocrlf=false`` is used throughout.

API (all paths are ``pathlib.Path`` or ``str``; every function returns a full sha or path):

* ``make_repo(path, files, message="init", tag=None, *, branch="main") -> sha`` -- new
  non-bare repository at ``path`` with one commit on ``branch``.
* ``commit(path, files, message="change", tag=None, *, delete=()) -> sha`` -- write
  ``files``, remove ``delete``, commit everything on the current branch.
* ``tag(path, name, rev="HEAD", message=None) -> sha`` -- lightweight tag, annotated when
  ``message`` is given; returns the sha of the tagged commit.
* ``branch(path, name, rev="HEAD")``, ``switch(path, name)`` -- create / check out a branch.
* ``bare_clone(src, dest) -> Path`` -- a bare clone of ``src``.
* ``git(path, *args) -> str`` -- run any git command there, stdout stripped.
* ``GIT_ENV`` -- the environment used (merge it into yours to commit by hand).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "GIT_ENV",
    "bare_clone",
    "branch",
    "commit",
    "git",
    "make_repo",
    "switch",
    "tag",
]

#: Fixed identity and dates (shas are stable); user/system configuration ignored.
GIT_ENV: dict[str, str] = {
    "GIT_AUTHOR_NAME": "Megaport Test",
    "GIT_AUTHOR_EMAIL": "test@megaport.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "Megaport Test",
    "GIT_COMMITTER_EMAIL": "test@megaport.invalid",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
}

_CONFIG = (
    "-c", "core.autocrlf=false",
    "-c", "core.safecrlf=false",
    "-c", "init.defaultBranch=main",
    "-c", "commit.gpgsign=false",
    "-c", "tag.gpgsign=false",
    "-c", "advice.detachedHead=false",
)  # fmt: skip


def git(path: str | os.PathLike[str], *args: str) -> str:
    """Run ``git <args>`` in ``path`` with :data:`GIT_ENV`; return stripped stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    proc = subprocess.run(
        ["git", *_CONFIG, *args],
        cwd=path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {path}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _write(path: Path, files: Mapping[str, bytes | str]) -> None:
    for name, content in files.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)


def make_repo(
    path: str | os.PathLike[str],
    files: Mapping[str, bytes | str],
    message: str = "init",
    tag: str | None = None,
    *,
    branch: str = "main",
) -> str:
    """Create a repository at ``path`` holding ``files`` in one commit on ``branch``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "--quiet")
    git(path, "symbolic-ref", "HEAD", f"refs/heads/{branch}")
    return commit(path, files, message, tag)


def commit(
    path: str | os.PathLike[str],
    files: Mapping[str, bytes | str],
    message: str = "change",
    tag: str | None = None,
    *,
    delete: Iterable[str] = (),
) -> str:
    """Write ``files``, delete ``delete``, commit all on the current branch; return the sha.
    ``tag`` adds a lightweight tag to the new commit."""
    path = Path(path)
    _write(path, files)
    for name in delete:
        (path / name).unlink()
    git(path, "add", "--all")
    git(path, "commit", "--quiet", "--allow-empty", "-m", message)
    sha = git(path, "rev-parse", "HEAD")
    if tag:
        git(path, "tag", tag, sha)
    return sha


def tag(
    path: str | os.PathLike[str], name: str, rev: str = "HEAD", message: str | None = None
) -> str:
    """Tag ``rev`` (annotated when ``message`` is given); return the tagged commit's sha."""
    if message is None:
        git(path, "tag", name, rev)
    else:
        git(path, "tag", "-a", name, "-m", message, rev)
    return git(path, "rev-parse", f"{name}^{{commit}}")


def branch(path: str | os.PathLike[str], name: str, rev: str = "HEAD") -> str:
    """Create branch ``name`` at ``rev`` (without switching); return its sha."""
    git(path, "branch", name, rev)
    return git(path, "rev-parse", name)


def switch(path: str | os.PathLike[str], name: str) -> None:
    """Check out the existing branch ``name``."""
    git(path, "checkout", "--quiet", name)


def bare_clone(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """A bare clone of ``src`` at ``dest`` (all branches and tags)."""
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    git(dest.parent, "clone", "--quiet", "--bare", str(Path(src).absolute()), str(dest))
    return dest
