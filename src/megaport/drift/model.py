"""What a drift check finds, as plain values: per hunk, per patch, per (ref, series).

The status words are the Yocto/quilt vocabulary and are part of megaport's stable output
(JSON, JUnit, annotations, exit codes); docs/drift.md documents them:

``clean``     the hunk lands where its header says, every context line matching
``offset``    it lands N lines away from where its header says
``fuzz``      it lands only when N (at most ``--fuzz``, default 2) context lines are ignored
``3way``      it lands only through a three-way merge with the patch's preimage blob
``applied``   upstream already contains the change
``missing``   the file the hunk changes is gone (deleted or renamed)
``conflict``  none of the above: the hunk must be rewritten by hand
``skipped``   (patches only) the patch touches only optional folders the tree lacks
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CLEAN = "clean"
OFFSET = "offset"
FUZZ = "fuzz"
THREEWAY = "3way"
APPLIED = "applied"
MISSING = "missing"
CONFLICT = "conflict"
SKIPPED = "skipped"

#: Every status word, from best to worst. A patch's status is its worst hunk's, a ref's its
#: worst patch's.
STATUSES = (SKIPPED, CLEAN, OFFSET, APPLIED, FUZZ, THREEWAY, MISSING, CONFLICT)
_RANK = {status: rank for rank, status in enumerate(STATUSES)}

#: Statuses with which the series still applies, but should be refreshed.
DRIFT = frozenset({OFFSET, FUZZ, THREEWAY, APPLIED})
#: Statuses with which it does not apply.
BROKEN = frozenset({MISSING, CONFLICT})

EXIT_CLEAN = 0
EXIT_DRIFT = 1
EXIT_BROKEN = 2
EXIT_USAGE = 3


def worst(statuses, default: str = CLEAN) -> str:
    """The worst of ``statuses`` (``default`` when there are none)."""
    found = list(statuses)
    return max(found, key=_RANK.__getitem__) if found else default


def exit_code_for(statuses) -> int:
    """0 when every status is clean (or skipped), 1 for drift that applies, 2 for breakage."""
    found = set(statuses)
    if found & BROKEN:
        return EXIT_BROKEN
    if found & DRIFT:
        return EXIT_DRIFT
    return EXIT_CLEAN


@dataclass(frozen=True)
class HunkDrift:
    """One hunk on one upstream tree.

    ``line`` is where it lands in upstream's file (1-based); ``patch_line`` the line of its
    ``@@`` header in the patch file. ``nearest_line``/``similarity`` are set for conflicts,
    ``new_path`` for a missing file git (or a same-name search) can follow, ``reason`` says why
    a file is missing or a conflict is not about context.
    """

    file: str
    index: int
    header: str
    status: str
    offset: int = 0
    fuzz: int = 0
    line: Optional[int] = None
    patch_line: Optional[int] = None
    nearest_line: Optional[int] = None
    similarity: Optional[float] = None
    new_path: Optional[str] = None
    reason: Optional[str] = None

    @property
    def label(self) -> str:
        """The status as people say it: ``offset 4``, ``fuzz 1``, ``clean``."""
        if self.status == OFFSET:
            return f"offset {self.offset:+d}"
        if self.status == FUZZ:
            return f"fuzz {self.fuzz}" + (f", offset {self.offset:+d}" if self.offset else "")
        return self.status

    @property
    def detail(self) -> str:
        """One line saying what was found, for reports and annotations."""
        where = f"{self.file} hunk #{self.index} {self.header}"
        if self.status == CONFLICT:
            text = f"{where}: conflict"
            if self.reason:
                text += f" ({self.reason})"
            if self.nearest_line is not None and self.similarity is not None:
                text += f"; nearest match at line {self.nearest_line} ({self.similarity:.0%} similar)"
            return text
        if self.status == MISSING:
            text = f"{where}: {self.reason or 'file is missing'}"
            if self.new_path:
                text += f"; likely moved to {self.new_path}"
            return text
        if self.status == APPLIED:
            return f"{where}: upstream already contains this change"
        if self.status == THREEWAY:
            return f"{where}: applies only through a 3-way merge" + (f" (at line {self.line})" if self.line else "")
        if self.status in (OFFSET, FUZZ):
            return f"{where}: {self.label}" + (f", lands at line {self.line}" if self.line else "")
        return f"{where}: {self.status}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "hunk": self.index,
            "header": self.header,
            "status": self.status,
            "offset": self.offset,
            "fuzz": self.fuzz,
            "line": self.line,
            "patch_line": self.patch_line,
            "nearest_line": self.nearest_line,
            "similarity": None if self.similarity is None else round(self.similarity, 3),
            "new_path": self.new_path,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class PatchDrift:
    """One patch on one upstream tree. ``before``/``after`` hold the contents of the files it
    touches before and after it (after: only when it applies), for ``megaport refresh``."""

    name: str
    subject: str
    path: Path
    status: str
    hunks: tuple[HunkDrift, ...]
    reason: str = ""
    before: dict[str, Optional[bytes]] = field(default_factory=dict, compare=False, repr=False)
    after: Optional[dict[str, Optional[bytes]]] = field(default=None, compare=False, repr=False)

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for hunk in self.hunks:
            counts[hunk.status] = counts.get(hunk.status, 0) + 1
        return counts

    @property
    def summary(self) -> str:
        """``2 clean, 1 offset`` (or the skip reason)."""
        if self.status == SKIPPED:
            return self.reason
        counts = self.counts
        return ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts) or "no hunks"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "subject": self.subject,
            "status": self.status,
            "reason": self.reason or None,
            "hunks": [hunk.to_dict() for hunk in self.hunks],
        }


@dataclass(frozen=True)
class SeriesDrift:
    """One series on one upstream commit."""

    ref: str
    sha: str
    series: str
    patches: tuple[PatchDrift, ...]
    reason: str = ""
    series_dir: Optional[Path] = field(default=None, compare=False)
    # apply's one-line error when ``megaport apply`` would refuse this series on this commit
    # (megaport.selection.decide); then the result is a conflict whatever its hunks say.
    refusal: str = ""
    # apply's dry run of this series lands, and apply still refuses it: a fallback that lands only by
    # skipping patches of folders the tree has. A refresh of this series cannot help.
    refused_landing: bool = False

    @property
    def status(self) -> str:
        """The hunks' worst word; ``conflict`` where apply refuses a series whose hunks all land."""
        words = self.hunk_status
        return CONFLICT if self.refusal and words not in BROKEN else words

    @property
    def hunk_status(self) -> str:
        """The worst word of the patches that were checked: what a refresh would have to fix."""
        return worst((p.status for p in self.patches if p.status != SKIPPED), default=CLEAN)

    @property
    def hunks(self) -> tuple[HunkDrift, ...]:
        return tuple(h for p in self.patches for h in p.hunks)

    @property
    def counts(self) -> dict[str, int]:
        """Hunks by status (skipped patches count once, as ``skipped``)."""
        counts: dict[str, int] = {}
        for patch in self.patches:
            if patch.status == SKIPPED:
                counts[SKIPPED] = counts.get(SKIPPED, 0) + 1
            for status, n in patch.counts.items():
                counts[status] = counts.get(status, 0) + n
        return counts

    @property
    def refused_only(self) -> bool:
        """Apply refuses it though no hunk is broken (fuzz, a merge, skipped patches): the report
        must say so on its own, as no hunk will."""
        return bool(self.refusal) and self.hunk_status not in BROKEN

    @property
    def exit_code(self) -> int:
        """2 where apply refuses (even on hunks that all land at drift's ``--fuzz``), else by word."""
        return EXIT_BROKEN if self.refusal else exit_code_for(p.status for p in self.patches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": self.ref,
            "sha": self.sha,
            "series": self.series,
            "reason": self.reason,
            "refusal": self.refusal or None,
            "status": self.status,
            "counts": {s: self.counts[s] for s in STATUSES if s in self.counts},
            "patches": [patch.to_dict() for patch in self.patches],
        }


@dataclass(frozen=True)
class DriftReport:
    """Everything one ``megaport drift`` run found."""

    repo: str
    results: tuple[SeriesDrift, ...]
    patches_dir: Optional[Path] = None

    @property
    def status(self) -> str:
        return worst((r.status for r in self.results), default=CLEAN)

    @property
    def exit_code(self) -> int:
        return max((r.exit_code for r in self.results), default=EXIT_CLEAN)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": 1,
            "repo": self.repo,
            "status": self.status,
            "exit_code": self.exit_code,
            "refs": [result.to_dict() for result in self.results],
        }
