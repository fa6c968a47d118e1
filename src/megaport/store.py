"""The store: a cache of upstream repositories (bare git repositories) under megaport's home.

Modelled on pre-commit's store:

* each upstream URL gets one bare repository, ``<home>/repos/<slug>-<sha256(url)[:12]>``;
* it is created atomically: ``git init --bare`` and the first fetch happen in a temporary
  directory beside it, which is renamed into place only once the fetch succeeded, so a
  failed or interrupted first fetch never leaves anything half-made behind;
* an exclusive ``flock`` on ``<home>/repos/<name>.lock`` is held while a repository is
  created, fetched into or copied from, so concurrent megaport processes never collide;
* only what the ref needs is fetched: a shallow (depth 1) fetch of exactly that branch,
  tag or commit, falling back to fetching all branches and tags (and unshallowing) when
  that is not enough, e.g. for an abbreviated sha;
* full shas and tags already in the cache are resolved without any network access, and
  every resolved commit is pinned under ``refs/megaport/pins/<sha>`` so it stays there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from megaport.errors import MegaportError
from megaport.git import GitError, checkout_branch, first_parent, is_shallow, list_refs, rev_parse, run_git

__all__ = ["CachedHistory", "ResolvedRef", "Store", "default_home", "normalize_url"]

log = logging.getLogger(__name__)

_FULL_SHA = re.compile(r"[0-9a-fA-F]{40}")
_ABBREV_SHA = re.compile(r"[0-9a-fA-F]{4,39}")
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_PIN_PREFIX = "refs/megaport/pins/"
_REMOTE_HEAD = "refs/megaport/remote-HEAD"  # where a cache keeps the remote's HEAD (default branch)
_FULL_REFSPECS = ("+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")


def default_home() -> Path:
    """``$MEGAPORT_HOME``, else ``$XDG_CACHE_HOME/megaport``, else ``~/.cache/megaport``."""
    home = os.environ.get("MEGAPORT_HOME")
    if home:
        return Path(home).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(os.path.expanduser(xdg)):  # the XDG spec ignores relative paths
        return Path(xdg).expanduser() / "megaport"
    return Path.home() / ".cache" / "megaport"


def _is_url(location: str) -> bool:
    """True for ``scheme://...`` and scp-like ``[user@]host:path`` (git's own rule: a colon
    with no slash before it)."""
    if _URL_SCHEME.match(location):
        return True
    colon = location.find(":")
    return colon > 0 and "/" not in location[:colon]


def _is_network(url: str) -> bool:
    return _is_url(url) and not url.lower().startswith("file://")


def normalize_url(url: str) -> str:
    """URLs (``https://``, ``ssh://``, ``git@host:path``, ``file://``) stay as given; a local
    path (relative, absolute or ``~``) becomes an absolute path, which must exist."""
    url = url.strip()
    if not url:
        raise MegaportError("no repository given (give a git URL or the path of a clone)")
    if _is_url(url):
        return url
    path = Path(url).expanduser()
    if not path.exists():
        raise MegaportError(f"repository not found: {url} (give a git URL or the path of a clone)")
    return str(path.resolve())


def display_url(url: str) -> str:
    """``url`` with any password/token replaced by ``***``, for messages."""
    if not _URL_SCHEME.match(url):
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _slug(url: str) -> str:
    last = re.split(r"[/:\\]", url.rstrip("/\\"))[-1]
    if last.endswith(".git"):
        last = last[: -len(".git")]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip(".-")
    return slug[:60] or "repo"


@dataclass(frozen=True)
class ResolvedRef:
    """A ref resolved to a commit: ``repo`` is the cached bare repository holding ``sha``.

    ``url`` is the normalised URL (local paths are absolute); ``ref`` is as the user gave it.
    """

    url: str
    ref: str
    sha: str
    repo: Path


# Version sort puts these pre-release suffixes before the release (0.14.0rc3 < 0.14.0).
_PRERELEASES = tuple(
    arg for suffix in ("rc", "-rc", ".rc", "dev", ".dev", "alpha", "beta") for arg in ("-c", f"versionsort.suffix={suffix}")
)


@dataclass(frozen=True)
class CachedHistory:
    """What a cache holds of an upstream's history, read without network: names to commits, the
    refs under a prefix, a first-parent line. drift's ``--ref`` globs, ranges and ``--last`` ask
    here (see :meth:`Store.history`) rather than run git on the cache themselves."""

    repo: Path

    def commit(self, name: str) -> str | None:
        """The commit a branch, tag, sha, full ref name or revision expression (``main~3``) names
        among what was fetched, or None. ``HEAD`` is the remote's default branch (the cache's own
        HEAD means nothing), and local names like FETCH_HEAD are never taken."""
        if name.startswith("-") or not self.repo.is_dir():
            return None
        base, suffix = re.match(r"^(.*?)([~^].*)?$", name).groups()
        if base == "HEAD":
            candidates = [_REMOTE_HEAD]
        elif base.startswith("refs/"):
            candidates = [base]
        else:
            candidates = [f"refs/heads/{base}", f"refs/tags/{base}"]
            if _ABBREV_SHA.fullmatch(base) or _FULL_SHA.fullmatch(base):
                candidates.append(base.lower())
        for candidate in candidates:
            sha = rev_parse(self.repo, f"{candidate}{suffix or ''}^{{commit}}")
            if sha:
                return sha
        return None

    def refs(self, prefix: str = "refs/tags/") -> list[tuple[str, str]]:
        """``(full ref name, commit)`` of every ref under ``prefix`` that names a commit, in
        version order (release candidates before their release), from one ``for-each-ref``."""
        return list_refs(self.repo, [prefix], sort="version:refname", config=_PRERELEASES)

    def first_parent(self, tip: str, *, exclude: str | None = None, count: int | None = None) -> list[str]:
        """The commits on ``tip``'s first-parent line, newest first, at most ``count``, stopping
        before those ``exclude`` has."""
        return first_parent(self.repo, tip, exclude=exclude, count=count)


class Store:
    """The cache of upstream repositories under ``home`` (default: :func:`default_home`)."""

    def __init__(self, home: Path | str | None = None) -> None:
        self.home = Path(home).expanduser().absolute() if home is not None else default_home()

    @property
    def repos_dir(self) -> Path:
        return self.home / "repos"

    def repo_path(self, url: str) -> Path:
        """Where the cache of the (normalised) ``url`` lives; it may not exist yet."""
        digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        return self.repos_dir / f"{_slug(url)}-{digest}"

    # -- resolve ---------------------------------------------------------------------
    def resolve(self, url: str, ref: str, *, progress: bool | None = None) -> ResolvedRef:
        """Make sure the commit ``ref`` names in ``url`` is in the cache; return it.

        ``ref`` is a branch, a tag, a full or abbreviated commit sha, ``HEAD`` (the remote's
        default branch) or a full ref name (``refs/pull/1/head``). Full shas and tags already
        cached need no network; everything else is fetched (branches move).

        ``progress``: True always draws a progress bar while fetching, False never, None
        (default) only for network URLs when stderr is a terminal.
        """
        ref = (ref or "").strip()
        url = normalize_url(url)
        if not ref:
            raise MegaportError("no ref given; give a tag, branch or commit sha")
        if ref.startswith("-") or any(c in ref for c in "\0\n\r \t~^:?*[\\") or ".." in ref:
            raise MegaportError(f"invalid ref '{ref}'; give a tag, branch or commit sha")
        show = progress if progress is not None else (_is_network(url) and _stderr_is_tty())
        repo = self.repo_path(url)
        with self._locked(repo):
            if not repo.is_dir():
                sha = self._create(repo, url, ref, show)
            else:
                try:
                    sha = self._resolve_in(repo, url, ref, show, first=False)
                except _RefNotFound as exc:
                    raise exc.error(url, ref) from None
        return ResolvedRef(url=url, ref=ref, sha=sha, repo=repo)

    def fetch_everything(self, url: str) -> Path:
        """Every branch and tag of ``url`` with full history in its cache (unshallowed), and the
        remote's HEAD (see :meth:`CachedHistory.commit`); the cache's path. Drift over whole ranges needs it."""
        url = normalize_url(url)
        repo = self.repo_path(url)
        if not repo.is_dir():
            self.resolve(url, "HEAD")  # creates the cache atomically, under the lock
        args = ["fetch", "--no-tags", "--prune", "--force"]
        with self._locked(repo):
            if is_shallow(repo):
                args.append("--unshallow")
            try:
                self._fetch(repo, url, [*args, url, *_FULL_REFSPECS, f"+HEAD:{_REMOTE_HEAD}"],
                            _is_network(url) and _stderr_is_tty())
            except GitError as exc:
                raise MegaportError(f"cannot fetch {display_url(url)}: {exc.reason or 'git fetch failed'}; "
                                    "check the URL or your network") from None
        return repo

    def history(self, url: str, *, everything: bool = False) -> CachedHistory:
        """The cache of ``url`` for history queries; ``everything`` first fetches every branch and
        tag with full history (:meth:`fetch_everything`), which globs, ranges and ``--last`` need."""
        url = normalize_url(url)
        return CachedHistory(self.fetch_everything(url) if everything else self.repo_path(url))

    def _create(self, repo: Path, url: str, ref: str, show: bool) -> str:
        """Create ``repo`` by initialising and fetching into a temporary directory beside it,
        renamed into place once the fetch succeeded."""
        for stale in self.repos_dir.glob(f".{repo.name}.tmp-*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{repo.name}.tmp-", dir=self.repos_dir))
        try:
            run_git(["init", "--quiet", "--bare", str(tmp)], self.repos_dir)
            run_git(["config", "megaport.url", url], tmp)
            try:
                sha = self._resolve_in(tmp, url, ref, show, first=True)
            except _RefNotFound as exc:
                if _has_refs(tmp):
                    # The repository itself was fetched fine: keep it, another ref may exist.
                    os.rename(tmp, repo)
                raise exc.error(url, ref) from None
            os.rename(tmp, repo)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return sha

    def _resolve_in(self, repo: Path, url: str, ref: str, show: bool, *, first: bool) -> str:
        """Find (fetching as needed) the commit of ``ref`` in ``repo`` and pin it.
        Raises :class:`_RefNotFound` or :class:`MegaportError`."""
        cached = None if first else self._cached(repo, ref)
        if cached is not None:
            sha, pinned = cached
        else:
            sha, pinned = self._find(repo, url, ref, show, first=first), False
        if not pinned:
            run_git(["update-ref", f"{_PIN_PREFIX}{sha}", sha], repo)
        return sha

    @staticmethod
    def _cached(repo: Path, ref: str) -> tuple[str, bool] | None:
        """``(commit, already pinned)`` for an immutable name the cache has (a full sha, a tag,
        an abbreviated sha), without network; None when ``ref`` must be fetched.

        One ``for-each-ref`` answers for the name as a branch, as a tag and for the pins (a
        warm apply of a tag runs only it): a name that is also a branch is a branch, as when
        fetching, since it may move.
        """
        full = _FULL_SHA.fullmatch(ref) is not None
        if full:
            patterns = [f"{_PIN_PREFIX}{ref.lower()}"]
        elif ref.startswith("refs/tags/"):
            patterns = [ref, _PIN_PREFIX]
        elif not ref.startswith("refs/"):
            patterns = [f"refs/heads/{ref}", f"refs/tags/{ref}", _PIN_PREFIX]
        else:
            return None
        found = dict(list_refs(repo, patterns))
        if f"refs/heads/{ref}" in found:
            return None
        sha = found.get(ref if ref.startswith("refs/tags/") else f"refs/tags/{ref}")
        if sha is None and (full or _ABBREV_SHA.fullmatch(ref)):
            sha = found.get(f"{_PIN_PREFIX}{ref.lower()}") or rev_parse(repo, f"{ref.lower() if full else ref}^{{commit}}")
        if sha is None:
            return None
        return sha, found.get(f"{_PIN_PREFIX}{sha}") == sha

    def _find(self, repo: Path, url: str, ref: str, show: bool, *, first: bool) -> str:
        # 1. Immutable names already here, without network: see _cached.

        # 2. A shallow fetch of exactly what the ref names (depth 1 unless the cache already
        #    holds full history, where an incremental fetch is as cheap and keeps it complete).
        shallow_ok = first or is_shallow(repo) or not _has_refs(repo)
        attempts: list[tuple[list[str], str]] = []
        if _FULL_SHA.fullmatch(ref):
            attempts.append(([ref.lower()], ref.lower()))
        elif ref == "HEAD":
            attempts.append(([f"+HEAD:{_REMOTE_HEAD}"], _REMOTE_HEAD))
        elif ref.startswith("refs/"):
            attempts.append(([f"+{ref}:{ref}"], ref))
        elif not (_ABBREV_SHA.fullmatch(ref) and len(ref) >= 7):
            # (a 7+ hex-digit name is almost surely an abbreviated sha: go straight to step 3)
            attempts.append(([f"+refs/heads/{ref}:refs/heads/{ref}"], f"refs/heads/{ref}"))
            attempts.append(([f"+refs/tags/{ref}:refs/tags/{ref}"], f"refs/tags/{ref}"))
        missing = 0
        for refspecs, local in attempts:
            args = ["fetch", "--no-tags"]
            if shallow_ok:
                args.append("--depth=1")
            try:
                self._fetch(repo, url, [*args, url, *refspecs], show)
            except GitError as exc:
                log.debug("narrow fetch of %s from %s failed: %s", ref, url, exc.reason)
                if _is_missing_ref(exc.stderr):
                    missing += 1
                    continue
                break  # a server refusing shas or shallow fetches, or no network: see step 3
            sha = rev_parse(repo, f"{local}^{{commit}}")
            if sha:
                return sha
        if attempts and missing == len(attempts) and not _ABBREV_SHA.fullmatch(ref):
            # The server said there is no such branch/tag (or full ref); fetching everything
            # would only find names we just asked for.
            raise _RefNotFound()

        # 3. Everything: all branches and tags, full history.
        args = ["fetch", "--no-tags", "--prune", "--force"]
        if is_shallow(repo):
            args.append("--unshallow")
        refspecs = list(_FULL_REFSPECS)
        if ref == "HEAD":
            refspecs.append(f"+HEAD:{_REMOTE_HEAD}")
        elif ref.startswith("refs/") and not ref.startswith(("refs/heads/", "refs/tags/")):
            refspecs.append(f"+{ref}:{ref}")
        try:
            self._fetch(repo, url, [*args, url, *refspecs], show)
        except GitError as exc:
            if ref.startswith("refs/") and _is_missing_ref(exc.stderr):
                raise _RefNotFound() from None
            raise MegaportError(
                f"cannot fetch {display_url(url)}: {exc.reason or 'git fetch failed'}; "
                "check the URL or your network"
            ) from None
        sha = CachedHistory(repo).commit(ref)  # among what was fetched
        if sha is None:
            raise _RefNotFound(ambiguous=_is_ambiguous(repo, ref))
        return sha

    @staticmethod
    def _fetch(repo: Path, url: str, args: list[str], show: bool) -> None:
        if show:
            from megaport.progress import run_git_with_progress

            args.insert(1, "--progress")
            run_git_with_progress(args, repo, description=f"fetching {_slug(url)}")
        else:
            run_git(args, repo)

    # -- checkout --------------------------------------------------------------------
    def checkout_to(self, resolved: ResolvedRef, dest: Path | str, branch: str) -> None:
        """Create ``dest`` (which must not exist) as an independent git repository with a
        work tree at ``resolved.sha`` on a new branch ``branch``.

        :meth:`init_from_cache` then ``git checkout -b <branch> <sha>``: about as fast as
        ``git worktree add``, whether the cache is shallow or not. On failure nothing is
        left at ``dest``.
        """
        dest = Path(dest).expanduser().absolute()
        if dest.exists() or dest.is_symlink():
            raise MegaportError(f"destination already exists: {dest} (remove it or choose another)")
        if not branch or branch.startswith("-"):
            raise MegaportError(f"invalid branch name '{branch}'; choose another")
        try:
            self.init_from_cache(resolved, dest)
            try:
                run_git(["checkout", "--quiet", "-b", branch, resolved.sha], dest)
            except GitError:
                if run_git(["check-ref-format", "--branch", branch], check=False).returncode:
                    raise MegaportError(f"invalid branch name '{branch}'; choose another") from None
                raise
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def init_from_cache(self, resolved: ResolvedRef, dest: Path | str) -> None:
        """Make ``dest`` (absent, or an empty directory) an independent git repository that
        holds ``resolved.sha`` and everything else in the cache, with nothing checked out
        (HEAD unborn, no index): write commits into it, then :meth:`check_out` a branch.

        The cache's object files are hard-linked (copied across file systems) under the
        store lock; a shallow cache gives a shallow repository. ``origin`` is set to
        ``resolved.url`` (not the cache), ``refs/megaport/upstream`` to the sha, and the
        repository keeps ``core.autocrlf=false``/``core.safecrlf=false`` so files stay
        byte-exact. On failure what this created is removed.
        """
        dest = Path(dest).expanduser().absolute()
        existed = dest.is_dir()
        if dest.is_symlink() or (dest.exists() and not (existed and not any(dest.iterdir()))):
            raise MegaportError(f"destination already exists: {dest} (remove it or choose another)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        gitdir = dest / ".git"
        try:
            run_git(["init", "--quiet", str(dest)], dest.parent)
            with self._locked(resolved.repo):
                _link_objects(resolved.repo / "objects", gitdir / "objects")
                shallow = resolved.repo / "shallow"
                if shallow.exists():
                    shutil.copyfile(shallow, gitdir / "shallow")
            # Written directly rather than by three `git config` runs: this is on the
            # critical path of every apply and each git process costs a few milliseconds.
            with open(gitdir / "config", "a", encoding="utf-8", errors="surrogateescape") as fh:
                fh.write(
                    "[core]\n\tautocrlf = false\n\tsafecrlf = false\n"
                    '[remote "origin"]\n'
                    f"\turl = {_config_quote(resolved.url)}\n"
                    "\tfetch = +refs/heads/*:refs/remotes/origin/*\n"
                )
            # update-ref refuses an object the repository lacks: the check that the commit is
            # (still) in the cache, without a rev-parse run of its own.
            if run_git(["update-ref", "refs/megaport/upstream", resolved.sha], dest, check=False).returncode:
                raise MegaportError(f"commit {resolved.sha} is not in the cache {resolved.repo}; resolve the ref again")
        except BaseException:
            shutil.rmtree(gitdir if existed else dest, ignore_errors=True)
            raise

    @staticmethod
    def check_out(worktree: Path | str, branch: str) -> None:
        """Check out the existing ``branch`` in ``worktree`` (made by :meth:`init_from_cache`),
        writing every file byte-exact; the work tree must have no conflicting files."""
        checkout_branch(worktree, branch)

    # -- locking ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, repo: Path) -> Iterator[None]:
        """Hold the exclusive lock of ``repo`` (``<repos>/<name>.lock``)."""
        try:
            repo.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MegaportError(
                f"cannot create {repo.parent}: {exc.strerror}; "
                "set MEGAPORT_HOME to a writable directory"
            ) from None
        lock_path = repo.parent / f"{repo.name}.lock"
        with open(lock_path, "a+b") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                log.info("waiting for another megaport process using %s", repo)
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class _RefNotFound(Exception):
    def __init__(self, *, ambiguous: bool = False) -> None:
        super().__init__()
        self.ambiguous = ambiguous

    def error(self, url: str, ref: str) -> MegaportError:
        if self.ambiguous:
            return MegaportError(
                f"ref '{ref}' is ambiguous in {display_url(url)}; give more digits of the sha"
            )
        return MegaportError(
            f"ref '{ref}' not found in {display_url(url)}; "
            "try a tag, branch or commit sha that exists there"
        )


def _is_missing_ref(stderr: str) -> bool:
    """True when a fetch failed only because the server has no such ref name."""
    return "couldn't find remote ref" in stderr.lower()


def _has_refs(repo: Path) -> bool:
    return bool(run_git(["for-each-ref", "--count=1", "--format=x"], repo).stdout.strip())


def _is_ambiguous(repo: Path, ref: str) -> bool:
    if not _ABBREV_SHA.fullmatch(ref):
        return False
    proc = run_git(["rev-parse", "--verify", f"{ref}^{{commit}}"], repo, check=False)
    return "ambiguous" in proc.stderr


def _config_quote(value: str) -> str:
    """``value`` as a double-quoted git config value."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\t", "\\t") + '"'


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _link_objects(src: Path, dst: Path) -> None:
    """Hard-link (or copy, across file systems) every object file and pack of ``src`` into
    ``dst``. Temporary files of a running fetch (``tmp_*``) are skipped; a pack's index is
    linked only with its pack."""
    can_link = True

    def put(a: Path, b: Path) -> None:
        nonlocal can_link
        if can_link:
            try:
                os.link(a, b)
                return
            except FileExistsError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                can_link = False
        shutil.copy2(a, b)

    with os.scandir(src) as top:
        entries = sorted(top, key=lambda e: e.name)
    for entry in entries:
        name = entry.name
        if len(name) == 2 and entry.is_dir():  # loose objects: objects/ab/cdef...
            target = dst / name
            target.mkdir(exist_ok=True)
            with os.scandir(entry.path) as loose:
                for obj in loose:
                    if not obj.name.startswith("tmp"):
                        put(Path(obj.path), target / obj.name)
        elif name == "pack":
            (dst / "pack").mkdir(exist_ok=True)
            files = {e.name for e in os.scandir(entry.path)}
            for pack in sorted(f for f in files if f.endswith(".pack") and f.startswith("pack-")):
                stem = pack[: -len(".pack")]
                if f"{stem}.idx" not in files:
                    continue
                for suffix in (".pack", ".idx", ".rev", ".bitmap"):
                    if f"{stem}{suffix}" in files:
                        put(Path(entry.path) / f"{stem}{suffix}", dst / "pack" / f"{stem}{suffix}")

