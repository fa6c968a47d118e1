"""Build a local git repository of upstream ``megatron/core`` from PyPI releases.

Tests need real upstream Megatron-LM code, but CI can only reach package
registries.  Every ``megatron-core`` release on PyPI ships upstream's
``megatron/core`` tree at the matching git tag ``core_vX.Y.Z``; the shipped
files are byte-identical to upstream's blobs at that tag.  (Checked for 0.5.0,
0.13.0 and 0.16.1 against a clone of NVIDIA/Megatron-LM: every file in the
wheel has upstream's blob sha.  The wheels leave out a few non-Python files
that upstream has in that folder, e.g. ``megatron/core/README.md``,
``megatron/core/datasets/Makefile``, some ``*.md`` and one ``*.cu`` file, and
they do not keep upstream's executable bits: every file is committed 100644.)

This module downloads those releases with pip (cached under :func:`cache_dir`)
and turns them into a git repository where each release is one commit tagged
like upstream (``core_v0.13.0``), in a linear history on ``main``.  Upstream's
files are never committed to this project; they are built at test time.

The repository is deterministic: the same versions give the same commit shas on
every machine.  Treat a repository returned for the default destination as
read-only and shared: clone it (``git clone --shared``/``git worktree``) before
changing anything, because a later call that needs more versions replaces it.

Environment:

``MEGAPORT_TEST_CACHE``
    cache folder (default ``~/.cache/megaport-tests``).
``MEGAPORT_TEST_OFFLINE=1``
    never run pip; use only releases already in the cache (missing ones make
    :func:`require_upstream` skip).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

__all__ = [
    "CORE_RELEASES",
    "UpstreamUnavailable",
    "UpstreamBuildError",
    "build_upstream_repo",
    "cache_dir",
    "default_repo_dir",
    "default_repo_dir_py312",
    "CORE_RELEASES_PY312",
    "dists_dir",
    "download_release",
    "read_release_files",
    "release_available",
    "require_upstream",
    "sort_versions",
    "tag_for",
    "unavailable_reason",
    "version_for_tag",
]

# megatron-core releases that install on Python 3.11, oldest first (checked with
# ``pip index versions megatron-core`` and ``pip download`` on 2025-11-22).
# Form each one comes in, as downloaded by download_release():
#   0.5.0, 0.6.0, 0.7.0   cp311 wheel, manylinux_2_17 / manylinux2014_x86_64 (no sdist on PyPI)
#   0.8.0, 0.9.0          cp311 wheel, manylinux_2_24 / manylinux_2_28_x86_64 (no sdist on PyPI)
#   0.10.0 ... 0.16.1     cp311 wheel, manylinux_2_24 / manylinux_2_28_x86_64 (an sdist exists too;
#                         for 0.13.0 its megatron/core files equal the wheel's minus the .so)
# 0.1.0-0.4.0 predate the ``core_v`` layout we port; 0.17.0 and later require Python >= 3.12.
CORE_RELEASES: List[str] = [
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "0.9.0",
    "0.10.0",
    "0.11.0",
    "0.12.0",
    "0.12.1",
    "0.12.2",
    "0.12.3",
    "0.13.0",
    "0.13.1",
    "0.14.0",
    "0.15.0",
    "0.15.1",
    "0.15.2",
    "0.15.3",
    "0.16.0",
    "0.16.1",
]

PROJECT = "megatron-core"
SUBTREE = "megatron/core/"
TAG_PREFIX = "core_v"

# Bump when the way the repository is built changes: repositories with another
# format number are rebuilt.
BUILD_FORMAT = 1
MARKER_NAME = "megaport-pypi-upstream.json"  # lives in .git/, not in the work tree

GIT_NAME = "megaport upstream-from-PyPI"
GIT_EMAIL = "upstream-from-pypi@megaport.invalid"
# Commit dates: 2020-01-01T00:00:00Z plus (major*10000 + minor*100 + patch) days,
# so a version's date does not depend on which other versions are built.
_EPOCH_BASE = 1577836800

_SKIP_SUFFIXES = (".so", ".pyd", ".pyc", ".pyo", ".dll", ".dylib")

# megatron-core releases that need Python >= 3.12 (typing.override), oldest first; their wheels
# also ship upstream's megatron/training. Built into their own repository
# (:func:`default_repo_dir_py312`), since a 3.11 interpreter cannot import them.
CORE_RELEASES_PY312: List[str] = ["0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2"]

# pip options that pick a wheel for CPython 3.11 on x86-64 Linux whatever the host is.
_WHEEL_TARGET = [
    "--only-binary=:all:",
    "--python-version", "3.11",
    "--implementation", "cp",
    "--abi", "cp311",
    "--abi", "abi3",
    "--abi", "none",
    "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux_2_24_x86_64",
    "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64",
    "--platform", "any",
]

# Text in pip's output that means the registry could not be reached at all.
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|ConnectTimeout|ConnectionError|ReadTimeout|Network is unreachable|"
    r"Name or service not known|Temporary failure in name resolution|nodename nor servname|"
    r"ProxyError|SSLError|Max retries exceeded|Could not fetch URL|Connection refused|"
    r"Failed to establish a new connection",
)


class UpstreamUnavailable(RuntimeError):
    """A release could not be downloaded (no network, registry error, no such release)."""


class UpstreamBuildError(RuntimeError):
    """The repository could not be built (git failed, destination not ours, bad archive)."""


# --------------------------------------------------------------------------- names


def tag_for(version: str) -> str:
    """Upstream's tag name for a megatron-core release: ``"0.13.0"`` -> ``"core_v0.13.0"``."""
    return TAG_PREFIX + version


def version_for_tag(tag: str) -> Optional[str]:
    """Inverse of :func:`tag_for`; None for tags that are not ``core_v...``."""
    return tag[len(TAG_PREFIX):] if tag.startswith(TAG_PREFIX) else None


def _version_key(version: str):
    try:
        from packaging.version import Version

        return (0, Version(version))
    except Exception:  # packaging missing or not a PEP 440 version
        parts = re.findall(r"\d+", version)
        return (1, tuple(int(p) for p in parts), version)


def sort_versions(versions: Iterable[str]) -> List[str]:
    """Unique versions in release order (PEP 440 ordering)."""
    return sorted(set(versions), key=_version_key)


def _commit_timestamp(version: str) -> int:
    nums = [int(p) for p in re.findall(r"\d+", version)[:3]]
    nums += [0] * (3 - len(nums))
    major, minor, patch = nums
    return _EPOCH_BASE + (major * 10000 + minor * 100 + patch) * 86400


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """``$MEGAPORT_TEST_CACHE`` if set, else ``~/.cache/megaport-tests``."""
    env = os.environ.get("MEGAPORT_TEST_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "megaport-tests"


def dists_dir() -> Path:
    """Where downloaded distribution files are kept."""
    return cache_dir() / "dists"


def default_repo_dir() -> Path:
    """Where :func:`build_upstream_repo` builds when no ``dest`` is given."""
    return cache_dir() / "upstream-core"


def default_repo_dir_py312() -> Path:
    """Where the repository of :data:`CORE_RELEASES_PY312` is built."""
    return cache_dir() / "upstream-core-py312"


def _offline() -> bool:
    return os.environ.get("MEGAPORT_TEST_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _cached_dist(version: str) -> Optional[Path]:
    d = dists_dir()
    if not d.is_dir():
        return None
    # A wheel is preferred over an sdist when both are there.
    for pattern in (
        f"megatron_core-{version}-*.whl",
        f"megatron_core-{version}.tar.gz",
        f"megatron-core-{version}.tar.gz",
        f"megatron_core-{version}.zip",
        f"megatron-core-{version}.zip",
    ):
        hits = sorted(d.glob(pattern))
        if hits:
            return hits[0]
    return None


def _clean_stale_downloads(d: Path, max_age_s: float = 24 * 3600) -> None:
    now = time.time()
    for p in d.glob(".download-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)


def _run_pip(args: Sequence[str], dest: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar", "off",
        "--timeout", "60",
        "--retries", "2",
        "-d", str(dest),
        *args,
    ]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _pip_error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("ERROR:"):
            return ln
    for ln in reversed(lines):
        if _NETWORK_ERRORS.search(ln):
            return ln[:300]
    return lines[-1][:300] if lines else "pip failed without output"


def _network_problem(output: str) -> Optional[str]:
    """A short description of why pip could not reach the registry, or None."""
    m = _NETWORK_ERRORS.search(output)
    if m is None:
        return None
    line = next(ln for ln in output.splitlines() if m.group(0) in ln)
    detail = re.search(
        r"(Failed to establish a new connection: [^'\")]*|Temporary failure in name resolution|"
        r"Name or service not known|Network is unreachable|Connection refused|Read timed out[^'\")]*|"
        r"(?:ConnectTimeout|SSLError|ProxyError)[^'\")]*)",
        line,
    )
    text = detail.group(1) if detail else line
    return " ".join(text.split())[:200]


def download_release(version: str) -> Path:
    """Path of the distribution file of ``megatron-core==version``, downloading it once.

    Files live in ``cache_dir()/dists``.  pip downloads into a private temporary
    folder and the finished file is renamed into place, so an interrupted
    download is never reused.  Tries, in order: a CPython 3.11 manylinux x86-64
    wheel (whatever this machine is), a wheel for this machine, the sdist (only
    downloaded and unpacked, never built).  Raises :class:`UpstreamUnavailable`.
    """
    cached = _cached_dist(version)
    if cached is not None:
        return cached
    if _offline():
        raise UpstreamUnavailable(
            f"{PROJECT}=={version} is not in {dists_dir()} and MEGAPORT_TEST_OFFLINE is set"
        )
    d = dists_dir()
    d.mkdir(parents=True, exist_ok=True)
    _clean_stale_downloads(d)
    spec = f"{PROJECT}=={version}"
    target_312 = [a.replace("3.11", "3.12").replace("cp311", "cp312") for a in _WHEEL_TARGET]
    attempts = [
        ("wheel for cp311 manylinux x86_64", _WHEEL_TARGET),
        ("wheel for cp312 manylinux x86_64", target_312),
        ("wheel for this machine", ["--only-binary=:all:"]),
        ("sdist", ["--no-binary=:all:"]),
    ]
    errors: List[str] = []
    for label, extra in attempts:
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=d))
        try:
            proc = _run_pip([*extra, spec], tmp)
            files = [p for p in tmp.iterdir() if p.is_file()]
            if proc.returncode == 0 and len(files) == 1:
                got = files[0]
                _check_archive(got)
                final = d / got.name
                os.replace(got, final)
                return final
            output = proc.stdout or ""
            net = _network_problem(output)
            if net is not None:
                raise UpstreamUnavailable(
                    f"cannot reach the package registry ({net}) to download {spec}"
                )
            errors.append(f"{label}: {_pip_error_line(output)}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise UpstreamUnavailable(f"cannot download {spec}: " + "; ".join(errors))


def _check_archive(path: Path) -> None:
    name = path.name
    try:
        if name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad is not None:
                raise UpstreamBuildError(f"{name}: corrupt member {bad}")
        elif name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as t:
                for _ in t:
                    pass
        else:
            raise UpstreamBuildError(f"unexpected distribution file {name}")
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as e:
        raise UpstreamBuildError(f"{name}: unreadable archive: {e}") from e


def release_available(version: str) -> bool:
    """True when the release is cached or can be downloaded now (downloads it)."""
    try:
        download_release(version)
        return True
    except UpstreamUnavailable:
        return False


def unavailable_reason(versions: Sequence[str]) -> Optional[str]:
    """None when all releases can be had, else a one-line reason fit for ``pytest.skip``."""
    for v in versions:
        try:
            download_release(v)
        except UpstreamUnavailable as e:
            return _one_line(f"megatron-core {v} from PyPI unavailable: {e}")
    return None


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- archives


# Besides megatron/core, the 3.12 wheels ship upstream's megatron/training (its argument parser,
# training loop and initialisation), as the wheel ships them.
KEPT_TREES = (SUBTREE, "megatron/training/")


def _keep(relpath: str) -> bool:
    if not relpath.startswith(KEPT_TREES) or relpath.endswith("/"):
        return False
    p = PurePosixPath(relpath)
    if p.is_absolute() or ".." in p.parts or "__pycache__" in p.parts:
        return False
    return not p.name.endswith(_SKIP_SUFFIXES)


def read_release_files(dist: Path) -> Dict[str, bytes]:
    """Files under ``megatron/core/`` in a wheel or sdist: ``{"megatron/core/x.py": bytes}``.

    Bytes are as shipped.  Compiled extensions (``.so``/``.pyd``/...) and
    ``__pycache__`` are left out.
    """
    dist = Path(dist)
    out: Dict[str, bytes] = {}
    name = dist.name
    if name.endswith(".whl"):
        with zipfile.ZipFile(dist) as z:
            for info in z.infolist():
                if not info.is_dir() and _keep(info.filename):
                    out[info.filename] = z.read(info)
    elif name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(dist) as t:
            for m in t:
                if not m.isfile():
                    continue
                parts = m.name.split("/", 1)  # strip "megatron_core-X.Y.Z/"
                if len(parts) == 2 and _keep(parts[1]):
                    f = t.extractfile(m)
                    assert f is not None
                    out[parts[1]] = f.read()
    elif name.endswith(".zip"):
        with zipfile.ZipFile(dist) as z:
            for info in z.infolist():
                parts = info.filename.split("/", 1)
                if not info.is_dir() and len(parts) == 2 and _keep(parts[1]):
                    out[parts[1]] = z.read(info)
    else:
        raise UpstreamBuildError(f"unexpected distribution file {dist}")
    if not out:
        raise UpstreamBuildError(f"{dist} has no files under {SUBTREE}")
    return out


def git_blob_sha(data: bytes) -> str:
    """The sha git gives a blob with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------- git


def _git_env() -> Dict[str, str]:
    env = dict(os.environ)
    # The user's and the system's git config must not change what we build.
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    env["LC_ALL"] = "C"
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
              "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_AUTHOR_DATE", "GIT_COMMITTER_DATE"):
        env.pop(k, None)
    return env


def _git(repo: Path, *args: str, input: Optional[bytes] = None) -> bytes:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        input=input,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_git_env(),
    )
    if proc.returncode != 0:
        raise UpstreamBuildError(
            f"git {' '.join(args)} failed in {repo}: {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout


def _quote_path(path: str) -> bytes:
    raw = path.encode("utf-8")
    if not any(c in path for c in ('"', "\\", "\n")) and not path.startswith('"'):
        return raw
    esc = path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return b'"' + esc.encode("utf-8") + b'"'


def _fast_import_stream(releases: Iterable[tuple]) -> Iterator[bytes]:
    """fast-import commands: one commit per (version, files) on refs/heads/main, plus tags."""
    yield b"feature done\n"
    for i, (version, files) in enumerate(releases):
        ts = _commit_timestamp(version)
        ident = f"{GIT_NAME} <{GIT_EMAIL}> {ts} +0000".encode()
        msg = f"{PROJECT} {version} (from PyPI)\n".encode()
        out = [
            b"commit refs/heads/main\n",
            b"mark :%d\n" % (i + 1),
            b"author " + ident + b"\n",
            b"committer " + ident + b"\n",
            b"data %d\n" % len(msg), msg,
        ]
        if i:
            out.append(b"from :%d\n" % i)
        out.append(b"deleteall\n")
        yield b"".join(out)
        for path in sorted(files):
            data = files[path]
            yield b"M 100644 inline " + _quote_path(path) + b"\n"
            yield b"data %d\n" % len(data)
            yield data
            yield b"\n"
        yield b"\n"
        yield f"reset refs/tags/{tag_for(version)}\n".encode() + b"from :%d\n\n" % (i + 1)
    yield b"done\n"


def _read_marker(repo: Path) -> Optional[dict]:
    try:
        with open(repo / ".git" / MARKER_NAME, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != BUILD_FORMAT:
        return None
    return data


def _repo_tags(repo: Path) -> set:
    out = _git(repo, "for-each-ref", "--format=%(refname:short)", "refs/tags")
    return set(out.decode().split())


def _has_all(repo: Path, versions: Sequence[str]) -> bool:
    marker = _read_marker(repo)
    if marker is None or not set(versions) <= set(marker.get("versions", ())):
        return False
    try:
        tags = _repo_tags(repo)
    except UpstreamBuildError:
        return False
    return all(tag_for(v) in tags for v in versions)


def _build_into(path: Path, versions: Sequence[str], dists: Dict[str, Path]) -> None:
    _git(path, "init", "-q")
    _git(path, "symbolic-ref", "HEAD", "refs/heads/main")
    for key, value in (
        ("core.autocrlf", "false"),
        ("core.eol", "lf"),
        ("core.safecrlf", "false"),
        ("gc.auto", "0"),
        ("user.name", GIT_NAME),
        ("user.email", GIT_EMAIL),
    ):
        _git(path, "config", key, value)

    def releases():
        for v in versions:
            yield v, read_release_files(dists[v])

    # The stream goes through a temporary file: no pipe deadlocks, and git
    # reports errors after reading all of it.
    with tempfile.TemporaryFile() as stream:
        for chunk in _fast_import_stream(releases()):
            stream.write(chunk)
        stream.seek(0)
        proc = subprocess.run(
            ["git", "-C", str(path), "fast-import", "--quiet", "--done", "--date-format=raw"],
            stdin=stream,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_git_env(),
        )
    if proc.returncode != 0:
        raise UpstreamBuildError(
            f"git fast-import failed: {proc.stderr.decode(errors='replace').strip()}"
        )

    _git(path, "reset", "-q", "--hard", "main")
    marker = {
        "format": BUILD_FORMAT,
        "project": PROJECT,
        "versions": list(versions),
        "dists": {v: dists[v].name for v in versions},
    }
    (path / ".git" / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_upstream_repo(versions: Sequence[str], *, dest: Optional[Path] = None) -> Path:
    """A git repository (with a work tree) holding the given megatron-core releases.

    Each release is one commit on ``main`` (message ``megatron-core X.Y.Z (from
    PyPI)``), tagged ``core_vX.Y.Z``, whose tree is exactly the release's
    ``megatron/core/`` files; commits are in version order, so files removed
    between releases are removed in the history.  Author, committer and dates
    are fixed, so shas depend only on the versions built.  ``main`` is checked
    out at the newest release.

    ``dest`` defaults to :func:`default_repo_dir`.  If the repository there
    already has every requested tag it is returned at once.  Otherwise it is
    rebuilt, with the versions it had plus the requested ones, in a temporary
    folder that is then renamed into place, under a file lock.  Raises
    :class:`UpstreamUnavailable` when a release cannot be downloaded.
    """
    wanted = sort_versions(versions)
    if not wanted:
        raise ValueError("build_upstream_repo needs at least one version")
    dest = Path(dest).expanduser() if dest is not None else default_repo_dir()
    dest = Path(os.path.abspath(dest))

    if _has_all(dest, wanted):  # fast path, no lock
        return dest

    with _locked(dest.parent / f".{dest.name}.lock"):
        if _has_all(dest, wanted):  # built by someone else while we waited
            return dest
        marker = _read_marker(dest)
        if dest.exists() or dest.is_symlink():
            ours = (dest / ".git" / MARKER_NAME).is_file()
            empty = dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir())
            if not (ours or empty):
                raise UpstreamBuildError(
                    f"{dest} exists and is not a repository built by {__name__}; "
                    "refusing to replace it"
                )
        all_versions = sort_versions([*wanted, *((marker or {}).get("versions") or [])])
        dists = {v: download_release(v) for v in all_versions}

        dest.parent.mkdir(parents=True, exist_ok=True)
        # We hold the lock, so build folders left here were abandoned by killed runs.
        for stale in [*dest.parent.glob(f".{dest.name}.build-*"), *dest.parent.glob(f".{dest.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
        try:
            _build_into(tmp, all_versions, dists)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it 0700
            if dest.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
                os.rename(dest, trash / "repo")
                os.rename(tmp, dest)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def require_upstream(versions: Sequence[str], *, dest: Optional[Path] = None) -> Path:
    """:func:`build_upstream_repo` for tests: skips the test when a release cannot be downloaded."""
    try:
        return build_upstream_repo(versions, dest=dest)
    except UpstreamUnavailable as e:
        import pytest

        pytest.skip(_one_line(f"upstream megatron-core from PyPI unavailable: {e}"))
        raise  # pragma: no cover - pytest.skip raises
