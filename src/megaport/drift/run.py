"""One drift run: resolve every ref first, then check the chosen series on each, reading blobs
straight from the cached repository (no checkout, one ``git cat-file`` process for all refs)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from megaport.catalogue import Catalogue, Series, load_catalogue
from megaport.errors import MegaportError
from megaport.git import BlobReader, ObjectReader, is_shallow
from megaport.plan import SeriesPlan, plan_series
from megaport.selection import Choice, Planner, decide, forced_choice
from megaport.store import Store

from .check import LoadedSeries, check_series, load_series
from .model import DriftReport, SeriesDrift
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
    # the --fuzz of the `megaport apply` whose verdict each result carries (apply's default)
    apply_fuzz: int = 0


def run_drift(options: DriftOptions, *, store: Optional[Store] = None, on_result: Callable[[SeriesDrift], None] | None = None) -> DriftReport:
    """Check the series on every ref; ``on_result`` sees each (ref, series) as it is done."""
    catalogue = load_catalogue(options.patches)
    mode = _series_mode(catalogue, options.series)
    store = store or Store()
    url, repo, targets = resolve_targets(store, options.repo, options.refs, last=options.last)
    results: list[SeriesDrift] = []
    with ObjectReader(repo) as objects:
        session = DriftSession(
            catalogue, objects, store, url, repo, targets, max_fuzz=options.max_fuzz, apply_fuzz=options.apply_fuzz
        )
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
        targets: Sequence[Target], *, max_fuzz: int = 2, apply_fuzz: int = 0,
    ) -> None:
        self.catalogue = catalogue
        self.objects = objects
        self.store = store
        self.url = url
        self.repo = repo
        self.max_fuzz = max_fuzz
        self.apply_fuzz = apply_fuzz
        self._loaded: dict[str, LoadedSeries] = {}
        self._tried: set[str] = set()
        self._fetch_failed: set[str] = set()  # repositories whose tested shas could not be fetched
        self._is_shallow: Optional[bool] = None
        self._memo: dict = {}
        self._plans: dict = {}  # apply's patch results, by patch and file contents (plan_series)
        tested = [t.sha for s in catalogue.series for t in s.tested if t.sha]
        bases = [sha for sha in dict.fromkeys(tested) if self._has_commit(sha)]
        self.moves = MoveFinder(repo, objects, bases + [t.sha for t in targets])

    def loaded(self, series: Series) -> LoadedSeries:
        if series.name not in self._loaded:
            self._loaded[series.name] = load_series(series)
        return self._loaded[series.name]

    def check(self, target: Target, mode) -> list[SeriesDrift]:
        """The results for one commit: the chosen series (auto), every series, or the named ones;
        each with apply's own verdict on it (:func:`megaport.selection.decide`)."""
        tree = self.objects.tree(target.sha)
        planner = self.planner(tree)
        if mode == AUTO:
            choices = [decide(self.catalogue, tree, max_fuzz=self.apply_fuzz, planner=planner)]
        else:
            named = self.catalogue.series if mode == ALL else mode
            choices = [
                forced_choice(self.catalogue, s.name, tree, max_fuzz=self.apply_fuzz, planner=planner) for s in named
            ]
        reason = "every series (--series all)" if mode == ALL else None
        return [self.verdict(target, tree, choice, reason or choice.reason) for choice in choices]

    def verdict(self, target: Target, tree: BlobReader, choice: Choice, reason: str) -> SeriesDrift:
        """Every hunk's word for the series apply's decision chose (or came nearest with)."""
        result = self.check_one(target, tree, choice.series, reason)
        return replace(result, refusal=choice.refusal, refused_landing=bool(choice.refusal) and choice.plan.ok)

    def planner(self, tree: BlobReader) -> Planner:
        """apply's dry run on ``tree``, on the patches this run parsed once."""

        def plan(series: Series, max_fuzz: int) -> SeriesPlan:
            patches = tuple(item.patch for item in self.loaded(series).patches)
            return plan_series(series, tree, max_fuzz=max_fuzz, patches=patches, memo=self._plans)

        return plan

    def check_one(self, target: Target, tree: BlobReader, series: Series, reason: str) -> SeriesDrift:
        """Every hunk's word for one series on one commit (where conflicts come closest included)."""
        return check_series(
            self.loaded(series), tree, ref=target.ref, sha=target.sha, reason=reason,
            preimage=self.preimages(series), locate_moved=self.locator(series, target.sha),
            max_fuzz=self.max_fuzz, memo=self._memo,
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
