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
from megaport.store import CachedHistory, Store, display_url, normalize_url

_GLOB = re.compile(r"[*?\[]")


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
    history = store.history(url, everything=whole_history)
    targets: list[Target] = []
    for spec in specs:
        spec = spec.strip()
        if is_range(spec):
            low, _, high = spec.partition("..")
            targets.extend(_range(history, url, high or "HEAD", low, None, spec))
        elif is_glob(spec):
            matched = _glob(history, url, spec)
            targets.extend(matched[-last:] if last is not None else matched)
        else:
            sha = history.commit(spec) if whole_history else None
            if sha is None:
                resolved = store.resolve(url, spec)
                history, sha = CachedHistory(resolved.repo), resolved.sha
            if last is not None:
                targets.extend(_range(history, url, spec, None, last, spec))
            else:
                targets.append(Target(spec, sha))
    unique: dict[tuple[str, str], Target] = {}
    for target in targets:
        unique.setdefault((target.ref, target.sha), target)
    return url, history.repo, list(unique.values())


def _glob(history: CachedHistory, url: str, pattern: str) -> list[Target]:
    full = pattern.startswith("refs/")
    targets = []
    for name, sha in history.refs("refs/" if full else "refs/tags/"):
        short = name if full else name[len("refs/tags/") :]
        if fnmatch.fnmatchcase(short, pattern):
            targets.append(Target(short, sha))
    if not targets:
        where = "refs" if full else "tags"
        raise MegaportError(f"no {where} of {display_url(url)} match '{pattern}'")
    return targets


def _range(history: CachedHistory, url: str, high: str, low: Optional[str], count: Optional[int], spec: str) -> list[Target]:
    tip = history.commit(high)
    if tip is None:
        raise MegaportError(f"'{high}' (in --ref {spec}) not found in {display_url(url)}")
    base = None
    if low:
        base = history.commit(low)
        if base is None:
            raise MegaportError(f"'{low}' (in --ref {spec}) not found in {display_url(url)}")
    shas = history.first_parent(tip, exclude=base, count=count)
    if not shas:
        raise MegaportError(f"--ref {spec} names no commits")
    return [Target(high if k == 0 else f"{high}~{k}", sha) for k, sha in reversed(list(enumerate(shas)))]
