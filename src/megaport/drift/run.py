"""One drift run: resolve every ref first, then check the chosen series on each, reading blobs
straight from the cached repository (no checkout, one ``git cat-file`` process for all refs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from megaport.catalogue import Catalogue, Series, load_catalogue
from megaport.errors import MegaportError
from megaport.git import BlobReader, ObjectReader, is_shallow
from megaport.selection import family, read_facts, recognised
from megaport.store import Store

from .check import LoadedSeries, check_series, load_series
from .model import BROKEN, CONFLICT, FUZZ, MISSING, OFFSET, SKIPPED, THREEWAY, DriftReport, SeriesDrift
from .refs import Target, resolve_targets
from .renames import MoveFinder

AUTO = "auto"
ALL = "all"


@dataclass(frozen=True)
class DriftOptions:
    repo: str
    refs: tuple[str, ...]
    series: tuple[str, ...] = (AUTO,)
    patches: Optional[str] = None
    last: Optional[int] = None
    max_fuzz: int = 2


def run_drift(options: DriftOptions, *, store: Optional[Store] = None, on_result: Callable[[SeriesDrift], None] | None = None) -> DriftReport:
    """Check the series on every ref; ``on_result`` sees each (ref, series) as it is done."""
    catalogue = load_catalogue(options.patches)
    mode = _series_mode(catalogue, options.series)
    store = store or Store()
    url, repo, targets = resolve_targets(store, options.repo, options.refs, last=options.last)
    results: list[SeriesDrift] = []
    with ObjectReader(repo) as objects:
        session = DriftSession(catalogue, objects, store, url, repo, targets, max_fuzz=options.max_fuzz)
        for target in targets:
            for result in session.check(target, mode):
                results.append(result)
                if on_result:
                    on_result(result)
    return DriftReport(repo=url, results=tuple(results), patches_dir=catalogue.root)


def _series_mode(catalogue: Catalogue, names: Sequence[str]) -> str | tuple[Series, ...]:
    names = tuple(n.strip() for name in names for n in name.split(",") if n.strip()) or (AUTO,)
    if len(names) == 1 and names[0] in (AUTO, ALL):
        return names[0]
    if AUTO in names or ALL in names:
        raise MegaportError("--series auto and --series all cannot be combined with series names")
    return tuple(catalogue.get(name) for name in dict.fromkeys(names))


class DriftSession:
    """What the checks of one run share: parsed series, the object reader, rename lookups."""

    def __init__(
        self, catalogue: Catalogue, objects: ObjectReader, store: Store, url: str, repo: Path,
        targets: Sequence[Target], *, max_fuzz: int = 2,
    ) -> None:
        self.catalogue = catalogue
        self.objects = objects
        self.store = store
        self.url = url
        self.repo = repo
        self.max_fuzz = max_fuzz
        self._loaded: dict[str, LoadedSeries] = {}
        self._tried: set[str] = set()
        self._fetch_failed: set[str] = set()  # repositories whose tested shas could not be fetched
        self._is_shallow: Optional[bool] = None
        self._memo: dict = {}
        tested = [t.sha for s in catalogue.series for t in s.tested if t.sha]
        bases = [sha for sha in dict.fromkeys(tested) if self._has_commit(sha)]
        self.moves = MoveFinder(repo, objects, bases + [t.sha for t in targets])

    def loaded(self, series: Series) -> LoadedSeries:
        if series.name not in self._loaded:
            self._loaded[series.name] = load_series(series)
        return self._loaded[series.name]

    def check(self, target: Target, mode) -> list[SeriesDrift]:
        """The results for one commit: the chosen series (auto), every series, or the named ones."""
        tree = self.objects.tree(target.sha)
        if mode == ALL:
            return [self.check_one(target, tree, s, "every series (--series all)") for s in self.catalogue.series]
        if mode != AUTO:
            return [self.check_one(target, tree, s, "chosen with --series") for s in mode]
        return [self.choose(target, tree)]

    def choose(self, target: Target, tree: BlobReader) -> SeriesDrift:
        """megaport's recognition (docs/selection.md); when it names none or several series, the
        one that fits best."""
        facts = read_facts(tree, self.catalogue.forks)
        series_pool = family(self.catalogue, facts) or list(self.catalogue.series)
        candidates = [s for s in series_pool if recognised(s, facts, tree)]
        described = facts.description
        if len(candidates) == 1:
            series = candidates[0]
            only = self.check_one(target, tree, series, f"{described} is in its range ({series.tested_range})")
            if only.status not in BROKEN:
                return only
            # As apply does: a recognised series that does not apply yields to the best fit.
            pool = series_pool
            why = f"{described} matches {series.name} but it does not apply"
        else:
            pool = candidates or series_pool
            why = f"{described} matches {len(candidates)} series" if candidates else f"{described} matches no series range"
        # Ranking needs only statuses; the nearest matches and moved files of the one reported are
        # looked for once it is chosen (a third of the time of a long history on drift_history.py).
        checked = [self.check_one(target, tree, s, "", diagnose=False) for s in pool]
        best = min(checked, key=fit_cost)
        if best.status in BROKEN:
            best = self.check_one(target, tree, self.catalogue.get(best.series), "")
        verdict = "fits best" if best.status not in BROKEN else "is the nearest (none applies)"
        return SeriesDrift(
            best.ref, best.sha, best.series, best.patches, f"{why}; {best.series} {verdict}", best.series_dir
        )

    def check_one(
        self, target: Target, tree: BlobReader, series: Series, reason: str, *, diagnose: bool = True
    ) -> SeriesDrift:
        return check_series(
            self.loaded(series), tree, ref=target.ref, sha=target.sha, reason=reason,
            preimage=self.preimages(series), locate_moved=self.locator(series, target.sha),
            max_fuzz=self.max_fuzz, memo=self._memo, diagnose=diagnose,
        )

    def preimages(self, series: Series) -> Callable[[Optional[str]], Optional[bytes]]:
        """Blob lookup for 3-way merges (see :meth:`_from_tested` when the cache lacks one)."""

        def lookup(oid: Optional[str]) -> Optional[bytes]:
            if not oid or set(oid) == {"0"}:
                return None
            self._from_tested(series, lambda: self.objects.blob(oid) is not None)
            return self.objects.blob(oid)

        return lookup

    def locator(self, series: Series, sha: str) -> Callable[[str, Optional[bytes]], tuple[Optional[str], str]]:
        """Where a missing file went; git's rename detection needs a commit that still has it."""

        def locate(path: str, preimage: Optional[bytes]) -> tuple[Optional[str], str]:
            self._from_tested(series, lambda: self.moves.has_base(path, sha))
            return self.moves.locate(sha, path, preimage)

        return locate

    def _from_tested(self, series: Series, satisfied: Callable[[], bool]) -> bool:
        """A shallow cache may lack a preimage blob, or any commit that still has a file upstream
        removed. Then the series' tested commits it lacks are fetched, newest first, one sha at a
        time (each at most once per run), until ``satisfied()``."""
        if satisfied():
            return True
        if series.repository in self._fetch_failed or not self._shallow():
            return False
        for tested in reversed(series.tested):
            sha = tested.sha
            if not sha or sha in self._tried:
                continue
            self._tried.add(sha)
            if self._has_commit(sha):
                continue
            try:
                self.store.resolve(self.url, sha, progress=False)
            except MegaportError:
                # Offline, or the catalogue names shas this repo lacks (another repository's series).
                self._fetch_failed.add(series.repository)
                return False
            self.objects.objects_added()
            self.moves.add_base(sha)
            if satisfied():
                return True
        return False

    def _shallow(self) -> bool:
        if self._is_shallow is None:
            self._is_shallow = is_shallow(self.repo)
        return self._is_shallow

    def _has_commit(self, sha: str) -> bool:
        found = self.objects.get(sha)
        return found is not None and found[0] == "commit"


def fit_cost(result: SeriesDrift) -> tuple:
    """How well a series fits, for ``--series auto`` without a single recognised series; the
    same order as ``megaport apply``'s selection: a series that applies beats one that does not,
    one that changes nothing (every patch skipped) fits nothing, fewer skipped patches come first
    (a series that skips its training patches on a full tree is from another era), then fewer
    conflicting hunks, merges, fuzz and offsets."""
    counts = result.counts
    broken = counts.get(CONFLICT, 0) + counts.get(MISSING, 0)
    checked = [p for p in result.patches if p.status != SKIPPED]
    return (
        broken > 0,
        not checked,
        broken,
        len(result.patches) - len(checked),
        counts.get(THREEWAY, 0),
        counts.get(FUZZ, 0),
        counts.get(OFFSET, 0),
    )
