"""Turn ``--ref`` arguments into commits of the cached repository, fetching once.

A ``--ref`` is one of:

* a tag, branch or commit sha (``core_v0.16.1``, ``main``, ``5be9626``): resolved by the store,
  which fetches only that ref (a cached tag or sha needs no network);
* a glob (``core_v0.1*``, ``core_v0.1[3-6].*``): every tag whose name matches, oldest version
  first; a glob starting with ``refs/`` matches full ref names (``refs/heads/release/*``);
* a range ``A..B`` (``main~10..main``): the commits on B's first-parent line that A lacks,
  oldest first, named ``B~k``;
* with ``--last N``, a plain ref stands for its newest N first-parent commits (``main`` with
  ``--last 3`` is ``main~2``, ``main~1``, ``main``): the same as ``main~N..main``; and a glob
  for its N newest tags (``core_v* --last 1`` is the newest release; release candidates sort
  before their release).

Globs, ranges and ``--last`` need the whole history: the first of them fetches every branch and
tag once (unshallowing the cache); the plain refs of the same run are then looked up locally.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megaport.errors import MegaportError
from megaport.git import rev_parse, run_git
from megaport.store import REMOTE_HEAD, Store, display_url, normalize_url

_GLOB = re.compile(r"[*?\[]")
# Version sort puts these pre-release suffixes before the release (0.14.0rc3 < 0.14.0).
_PRERELEASES = tuple(
    arg for suffix in ("rc", "-rc", ".rc", "dev", ".dev", "alpha", "beta") for arg in ("-c", f"versionsort.suffix={suffix}")
)


@dataclass(frozen=True)
class Target:
    """One commit to check: ``ref`` is how reports name it."""

    ref: str
    sha: str


def is_glob(spec: str) -> bool:
    return bool(_GLOB.search(spec))


def is_range(spec: str) -> bool:
    return ".." in spec


def resolve_targets(
    store: Store, url: str, specs: Sequence[str], *, last: Optional[int] = None
) -> tuple[str, Path, list[Target]]:
    """``(normalised url, cached repository, commits)`` for the ``--ref`` arguments, in order,
    without duplicates. Raises :class:`MegaportError` for refs that match nothing."""
    if not specs:
        raise MegaportError("give at least one --ref")
    for spec in specs:
        if not spec.strip():
            raise MegaportError("empty --ref")
        if "..." in spec:
            raise MegaportError(f"'{spec}': symmetric ranges (A...B) are not supported; use A..B")
    if last is not None and last < 1:
        raise MegaportError("--last must be at least 1")
    url = normalize_url(url)
    whole_history = last is not None or any(is_glob(s) or is_range(s) for s in specs)
    repo = store.fetch_everything(url) if whole_history else store.repo_path(url)
    targets: list[Target] = []
    for spec in specs:
        spec = spec.strip()
        if is_range(spec):
            low, _, high = spec.partition("..")
            targets.extend(_range(repo, url, high or "HEAD", low, None, spec))
        elif is_glob(spec):
            matched = _glob(repo, url, spec)
            targets.extend(matched[-last:] if last is not None else matched)
        else:
            sha = _lookup(repo, spec) if whole_history else None
            if sha is None:
                resolved = store.resolve(url, spec)
                repo, sha = resolved.repo, resolved.sha
            if last is not None:
                targets.extend(_range(repo, url, spec, None, last, spec))
            else:
                targets.append(Target(spec, sha))
    unique: dict[tuple[str, str], Target] = {}
    for target in targets:
        unique.setdefault((target.ref, target.sha), target)
    return url, repo, list(unique.values())


def _glob(repo: Path, url: str, pattern: str) -> list[Target]:
    full = pattern.startswith("refs/")
    names = run_git(
        [*_PRERELEASES, "for-each-ref", "--sort=version:refname", "--format=%(refname)",
         *(["refs/"] if full else ["refs/tags/"])],
        repo,
    ).stdout.split()
    targets = []
    for name in names:
        short = name if full else name[len("refs/tags/") :]
        if fnmatch.fnmatchcase(short, pattern):
            sha = rev_parse(repo, f"{name}^{{commit}}")
            if sha:
                targets.append(Target(short, sha))
    if not targets:
        where = "refs" if full else "tags"
        raise MegaportError(f"no {where} of {display_url(url)} match '{pattern}'")
    return targets


def _range(repo: Path, url: str, high: str, low: Optional[str], count: Optional[int], spec: str) -> list[Target]:
    tip = _lookup(repo, high)
    if tip is None:
        raise MegaportError(f"'{high}' (in --ref {spec}) not found in {display_url(url)}")
    args = ["rev-list", "--first-parent"]
    if count is not None:
        args.append(f"--max-count={count}")
    args.append(tip)
    if low:
        base = _lookup(repo, low)
        if base is None:
            raise MegaportError(f"'{low}' (in --ref {spec}) not found in {display_url(url)}")
        args.append(f"^{base}")
    shas = run_git(args, repo).stdout.split()
    if not shas:
        raise MegaportError(f"--ref {spec} names no commits")
    return [Target(high if k == 0 else f"{high}~{k}", sha) for k, sha in reversed(list(enumerate(shas)))]


def _lookup(repo: Path, name: str) -> Optional[str]:
    """A branch, tag, sha or revision expression (``main~3``) among what the cache holds."""
    if not (repo / "HEAD").exists() and not (repo / ".git").exists():
        return None
    if name.startswith("-"):
        return None
    base, suffix = re.match(r"^(.*?)([~^].*)?$", name).groups()
    # The cache's own HEAD is not the remote's: Store.fetch_everything records that one.
    candidates = (REMOTE_HEAD,) if base == "HEAD" else (f"refs/heads/{base}", f"refs/tags/{base}", base)
    for candidate in candidates:
        sha = rev_parse(repo, f"{candidate}{suffix or ''}^{{commit}}")
        if sha:
            return sha
    return None


