"""Choosing the series for an upstream commit.

Core release tags live on release branches, so ancestry cannot place a commit between them. The
tree itself says where it belongs: the version in ``megatron/core/package_info.py`` and which
files exist. When that names exactly one series it is checked by a dry run; when it names none or
several, every candidate is dry-run and the one that fits best wins. The reason is always printed.
``megaport drift`` asks the same :func:`decide`, so it refuses exactly the trees apply refuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from megaport.catalogue import UPSTREAM_REPOSITORY, Catalogue, Fork, Series
from megaport.errors import MegaportError
from megaport.plan import SeriesPlan, TreeReader, plan_series

PACKAGE_INFO = "megatron/core/package_info.py"


@dataclass(frozen=True)
class TreeFacts:
    """What recognition looks at in an upstream tree."""

    core_version: tuple[int, ...] | None
    # The fork the tree belongs to (a [[fork]] of the catalogue whose mark it holds), and that mark.
    fork: Fork | None = None
    fork_mark: str = ""

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.core_version)) if self.core_version else "unknown"

    @property
    def repository(self) -> str:
        return self.fork.repository if self.fork else UPSTREAM_REPOSITORY

    @property
    def description(self) -> str:
        if self.core_version is None:
            text = "tree without megatron/core/package_info.py"
        else:
            text = "megatron/core " + ".".join(map(str, self.core_version))
        if self.fork is not None:
            text = f"{self.fork.repository} tree ({self.fork_mark}), {text}"
        return text


@dataclass(frozen=True)
class Choice:
    """The chosen series, its dry-run plan, and why it was chosen."""

    series: Series
    plan: SeriesPlan
    reason: str
    # apply's one-line error when the series does not port the tree ("" when it does): drift
    # reports the same line, as a conflict.
    refusal: str = ""


def read_facts(tree: TreeReader, forks: tuple[Fork, ...] = ()) -> TreeFacts:
    fork, mark = tree_fork(tree, forks)
    return TreeFacts(core_version=core_version(tree.read(PACKAGE_INFO)), fork=fork, fork_mark=mark)


def tree_fork(tree: TreeReader, forks: tuple[Fork, ...]) -> tuple[Fork | None, str]:
    """The first fork whose mark the tree holds, and the mark in words ('pretrain_gpt.py has ...')."""
    for fork in forks:
        for path, text in fork.marks:
            if text and _file_has(tree, path, text):
                return fork, f"{path} has {text.strip()!r}"
            if not text and tree.exists(path):
                return fork, f"{path} exists"
    return None, ""


def family(catalogue: Catalogue, facts: TreeFacts) -> list[Series]:
    """The series that may port the tree: its fork's, or upstream's for any other tree. A fork's
    tree never gets an upstream series by recognition or by the best-fit fallback, and back."""
    return [s for s in catalogue.series if s.repository == facts.repository]


def core_version(package_info: bytes | None) -> tuple[int, ...] | None:
    """MAJOR/MINOR/PATCH from upstream's package_info.py, without importing it."""
    if package_info is None:
        return None
    text = package_info.decode("utf-8", "replace")
    numbers = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"^{name}\s*=\s*(\d+)", text, re.MULTILINE)
        if not match:
            return None
        numbers.append(int(match.group(1)))
    return tuple(numbers)


def recognised(series: Series, facts: TreeFacts, tree: TreeReader) -> bool:
    """True when the tree's version and files match the series' recognise rules."""
    rules = series.recognise
    version = facts.core_version
    if rules.core_min is not None and (version is None or version < rules.core_min):
        return False
    if rules.core_max is not None and (version is None or version >= rules.core_max):
        return False
    if any(not tree.exists(path) for path in rules.present):
        return False
    if any(tree.exists(path) for path in rules.absent):
        return False
    if any(not _file_has(tree, path, text) for path, text in rules.contains):
        return False
    return not any(_file_has(tree, path, text) for path, text in rules.lacks)


def _file_has(tree: TreeReader, path: str, text: str) -> bool:
    """Whether the file holds ``text``; a mark that starts with a newline (a whole line) also holds
    on the file's first line."""
    content = tree.read(path)
    return content is not None and text.encode("utf-8") in b"\n" + content


class FolderReader:
    """A tree on disk as a :class:`TreeReader` (a ported tree, an exported baseline)."""

    def __init__(self, root):
        self.root = Path(root)

    def read(self, path: str) -> bytes | None:
        file = self.root / path
        return file.read_bytes() if file.is_file() else None

    def exists(self, path: str) -> bool:
        return (self.root / path).exists()


Planner = Callable[[Series, int], SeriesPlan]
"""(series, max_fuzz) -> its dry run on the tree: drift passes one that reuses its parsed patches."""

#: The most fuzz ``--fuzz`` accepts; a refusal looks this far for a fuzz that would port the tree.
MAX_FUZZ = 3


def choose_series(catalogue: Catalogue, tree: TreeReader, *, max_fuzz: int = 0) -> Choice:
    """Pick the series for a tree, or fail with the nearest series and where it conflicts."""
    choice = decide(catalogue, tree, max_fuzz=max_fuzz)
    if choice.refusal:
        raise MegaportError(choice.refusal)
    return choice


def decide(catalogue: Catalogue, tree: TreeReader, *, max_fuzz: int = 0, planner: Planner | None = None) -> Choice:
    """The one decision ``apply`` and ``drift`` share: the series that ports the tree at
    ``max_fuzz`` and why, or the nearest one with apply's one-line refusal. Drift asks this
    rather than ranking its own hunk words, so it never calls a tree fine that apply refuses."""
    plan = planner or _planner(tree)
    return _at_fuzz(lambda fuzz: _select(catalogue, tree, lambda series: plan(series, fuzz)), max_fuzz)


def _at_fuzz(choose_at: Callable[[int], Choice], max_fuzz: int) -> Choice:
    """The choice at ``max_fuzz``; a refusal also names the fuzz that would port the tree."""
    choice = choose_at(max_fuzz)
    if not choice.refusal:
        return choice
    return replace(choice, refusal=choice.refusal + fuzz_hint(choose_at, max_fuzz))


def _planner(tree: TreeReader) -> Planner:
    return lambda series, max_fuzz: plan_series(series, tree, max_fuzz=max_fuzz)


def _select(catalogue: Catalogue, tree: TreeReader, plan: Callable[[Series], SeriesPlan]) -> Choice:
    """Recognition, then the best-fit fallback (docs/selection.md); a Choice with ``refusal``
    set (the nearest series) when nothing ports."""
    facts = read_facts(tree, catalogue.forks)
    series_pool = family(catalogue, facts)
    if not series_pool:
        raise MegaportError(f"no series in the catalogue is for {facts.repository} trees ({facts.description})")
    candidates = [s for s in series_pool if recognised(s, facts, tree)]
    described = facts.description
    if len(candidates) == 1:
        first = plan(candidates[0])
        if first.ok:
            return Choice(candidates[0], first, f"{described} is in its range ({candidates[0].tested_range})")
        plans = [first] + [plan(s) for s in series_pool if s is not candidates[0]]
        why = f"{described} matches {candidates[0].name} but it does not apply"
    else:
        pool = candidates or series_pool
        plans = [plan(s) for s in pool]
        why = (
            f"{described} matches {len(candidates)} series" if candidates else f"{described} matches no series range"
        )
    core_only = _core_only(tree)
    fitting = [p for p in plans if p.ok and _applied_patches(p) and (core_only or not _skipped_patches(p))]
    if fitting:
        best = min(fitting, key=_fit_cost)
        return Choice(best.series, best, f"{why}; a dry run fits {best.series.name} best")
    nearest = min(plans, key=lambda p: (p.conflicts, -_applied_patches(p)))
    return Choice(nearest.series, nearest, why, refusal=no_fit_message(nearest, why))


def fuzz_hint(choose_at: Callable[[int], Choice], max_fuzz: int) -> str:
    """'; --fuzz N ports it with SERIES, ...' for the smallest N above ``max_fuzz`` at which the
    same decision ports the tree, saying which hunks then land on unmatched context; '' when none
    does. Porting at the most fuzz is tried first: a tree no fuzz ports costs one more dry run."""
    if max_fuzz >= MAX_FUZZ:
        return ""
    choice, fuzz = choose_at(MAX_FUZZ), MAX_FUZZ
    if choice.refusal:
        return ""
    for less in range(max_fuzz + 1, MAX_FUZZ):
        found = choose_at(less)
        if not found.refusal:
            choice, fuzz = found, less
            break
    fuzzy = [h for p in choice.plan.patches if p.result for f in p.result.files for h in f.hunks if h.outcome == "fuzz"]
    where = ", ".join(f"{h.file} hunk #{h.index} at line {h.line}" for h in fuzzy[:3]) + (", ..." if len(fuzzy) > 3 else "")
    hunks = f"{len(fuzzy)} hunk" + ("s" if len(fuzzy) != 1 else "")
    return (
        f"; --fuzz {fuzz} would port it with {choice.series.name}, placing {hunks} where up to {fuzz} of "
        f"their context lines do not match upstream ({where}): check those lines in the ported tree"
    )


def _fit_cost(plan: SeriesPlan) -> tuple[int, int, int, int]:
    """Fewest skipped patches first: a series that skips its training patches on a full tree is
    from another era even when its core patches happen to land. Then the least fuzz, then the
    most patches applied (a patch that lands is a fix the tree gets: main's 0.13.0rc0 commits of
    2025-04 took core-0.10-0.12, core 0.10 and 0.11's series then, for its fewer offsets and lost core-0.12's converter patches),
    then the fewest offsets."""
    counts = plan.hunk_counts
    return (_skipped_patches(plan), counts.get("fuzz", 0), -_applied_patches(plan), counts.get("offset", 0))


def _core_only(tree: TreeReader) -> bool:
    """PyPI's megatron-core: megatron/ holds core alone, so skipping the other folders' patches is
    expected. On a full tree a series that skips patches is from another era, even if the rest lands."""
    entries = getattr(tree, "list_dir", lambda path: None)("megatron") or []
    return set(entries) <= {"core", "__init__.py"}


def _skipped_patches(plan: SeriesPlan) -> int:
    return sum(1 for p in plan.patches if p.status == "skipped")


def _applied_patches(plan: SeriesPlan) -> int:
    return sum(1 for p in plan.patches if p.status in ("applied", "already-applied"))


def no_fit_message(plan: SeriesPlan, why: str) -> str:
    """One line: nearest series, how many hunks conflict, and where."""
    failed = plan.failed
    if failed is None:
        skipped = [p.name for p in plan.patches if p.status == "skipped"]
        detail = f"it applies only by skipping {', '.join(skipped)}, whose folders this tree lacks"
    else:
        detail = f"{plan.conflicts} hunk(s) conflict in {failed.name}, first at {failure_location(failed.result)}"
    return (
        f"no series fits this tree ({why}); nearest is {plan.series.name}: {detail}. "
        "Try --series NAME, or refresh a series for this ref"
    )


def failure_location(result) -> str:
    """'file hunk #N (expected line L, nearest match line M, 83% similar)' for the first failed hunk."""
    for file_result in result.files:
        if file_result.error:
            return f"{file_result.path}: {file_result.error}"
        for hunk in file_result.hunks:
            if hunk.outcome == "failed":
                nearest = (
                    f", nearest match at line {hunk.nearest_line} ({hunk.similarity:.0%} similar)"
                    if hunk.nearest_line
                    else ", no similar lines found"
                )
                return f"{hunk.file} hunk #{hunk.index} {hunk.header}{nearest}"
    return "?"


def forced_choice(
    catalogue: Catalogue, name: str, tree: TreeReader, *, max_fuzz: int = 0, planner: Planner | None = None
) -> Choice:
    """``--series NAME``: no recognition, but the same dry run, and the same refusal in drift."""
    series = catalogue.get(name)
    plan = planner or _planner(tree)
    return _at_fuzz(lambda fuzz: _forced(series, tree, plan(series, fuzz)), max_fuzz)


def _forced(series: Series, tree: TreeReader, dry_run: SeriesPlan) -> Choice:
    """The named series, refused with the patch and hunk where its dry run stopped."""
    refusal = ""
    if not dry_run.ok:
        commit = getattr(tree, "commit", "")
        where = f" to {commit[:12]}" if commit else ""
        refusal = f"series {series.name} does not apply{where}: {dry_run.failed.name}: {failure_location(dry_run.failed.result)}"
    return Choice(series, dry_run, "chosen with --series", refusal=refusal)
