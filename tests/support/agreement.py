"""Do `megaport drift` and `megaport apply` agree on a ref? Drift exits at most 1 exactly where
apply ports it, with apply's series, and where apply refuses drift carries apply's own one-line
error (issue 40). Used by tests/test_drift_agrees_fullclone.py and tools/drift-agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from support.porting import port

from megaport.drift.run import DriftOptions, run_drift


@dataclass(frozen=True)
class Agreement:
    """One ref: drift's verdict beside apply's dry run."""

    ref: str
    sha: str
    drift_exit: int
    drift_series: str
    drift_refusal: str
    apply_exit: int
    apply_series: str
    apply_error: str

    @property
    def ports(self) -> bool:
        return self.apply_exit == 0

    @property
    def problem(self) -> str:
        """'' where they agree, else how they differ."""
        if self.ports != (self.drift_exit <= 1):
            return f"apply exit {self.apply_exit}, drift exit {self.drift_exit} ({self.drift_refusal or 'no refusal'})"
        if self.ports and self.apply_series != self.drift_series:
            return f"apply chose {self.apply_series}, drift {self.drift_series}"
        if not self.ports and self.apply_error != self.drift_refusal:
            return f"apply says {self.apply_error!r}, drift {self.drift_refusal!r}"
        return ""


def agreements(
    clone: Path | str, refs: Sequence[tuple[str, str]], work: Path, *, patches: Path | None = None
) -> list[Agreement]:
    """(name, sha) pairs: one drift run over every sha (``--series auto``, apply's fuzz 0), then
    ``megaport apply --dry-run`` of each sha; one :class:`Agreement` per ref, in order. ``patches``:
    a catalogue other than the shipped one."""
    shas = tuple(dict.fromkeys(sha for _, sha in refs))
    report = run_drift(DriftOptions(repo=str(clone), refs=shas, patches=str(patches) if patches else None))
    drifted = {result.sha: result for result in report.results}
    extra = ("--patches", str(patches)) if patches else ()
    found = []
    for name, sha in refs:
        code, applied, _ = port(clone, sha, work / sha[:12], "--dry-run", *extra)
        result = drifted[sha]
        found.append(Agreement(
            ref=name, sha=sha, drift_exit=result.exit_code, drift_series=result.series,
            drift_refusal=result.refusal, apply_exit=code, apply_series=applied.get("series") or "",
            apply_error=applied.get("error") or "",
        ))
    return found
