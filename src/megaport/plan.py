"""Planning a series on an upstream tree in memory: what every patch and hunk would do.

Nothing here writes: ``apply`` writes a plan only when every patch in it succeeded, which is how a
failing series leaves the destination exactly as it was. ``--dry-run`` and series selection use the
same plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from megaport.catalogue import Series
from megaport.engine import Patch, PatchResult, apply_patch, check_patch_paths, parse_patch
from megaport.engine.blob import git_blob_id
from megaport.errors import MegaportError

SKIPPED = "skipped"


class TreeReader(Protocol):
    """What planning needs of an upstream tree: file bytes and whether a path exists."""

    def read(self, path: str) -> bytes | None: ...

    def exists(self, path: str) -> bool: ...


@dataclass(frozen=True)
class PatchPlan:
    """One patch's outcome; ``result`` is None when it was skipped."""

    name: str
    subject: str
    status: str  # applied | already-applied | failed | skipped
    result: PatchResult | None
    reason: str = ""

    def to_dict(self) -> dict:
        hunks = []
        if self.result is not None:
            for file_result in self.result.files:
                for hunk in file_result.hunks:
                    hunks.append(
                        {
                            "file": hunk.file,
                            "hunk": hunk.index,
                            "outcome": hunk.outcome,
                            "offset": hunk.offset,
                            "fuzz": hunk.fuzz,
                            "line": hunk.line,
                            **(
                                {"nearest_line": hunk.nearest_line, "similarity": hunk.similarity}
                                if hunk.outcome == "failed"
                                else {}
                            ),
                        }
                    )
        data = {"name": self.name, "subject": self.subject, "status": self.status, "hunks": hunks}
        if self.reason:
            data["reason"] = self.reason
        return data


@dataclass(frozen=True)
class SeriesPlan:
    """A series planned on one tree: per-patch outcomes and, when it fits, the final file contents."""

    series: Series
    patches: tuple[PatchPlan, ...]
    parsed: tuple[Patch, ...]

    @property
    def ok(self) -> bool:
        return all(p.status != "failed" for p in self.patches)

    @property
    def failed(self) -> PatchPlan | None:
        return next((p for p in self.patches if p.status == "failed"), None)

    @property
    def hunk_counts(self) -> dict[str, int]:
        """Hunks by outcome: how well the series fits, for choosing between candidates."""
        counts: dict[str, int] = {}
        for plan in self.patches:
            if plan.result is None:
                continue
            for file_result in plan.result.files:
                for hunk in file_result.hunks:
                    counts[hunk.outcome] = counts.get(hunk.outcome, 0) + 1
        return counts

    @property
    def conflicts(self) -> int:
        return self.hunk_counts.get("failed", 0)


def load_patches(series: Series) -> tuple[Patch, ...]:
    """Parse a series and refuse unsafe paths before anything is read or written."""
    patches = []
    for patch_file in series.patches:
        patch = parse_patch(patch_file.text(), name=patch_file.name)
        check_patch_paths(patch)
        for file_patch in patch.files:
            if file_patch.new_mode and file_patch.new_mode.endswith("120000"):
                raise MegaportError(
                    f"{patch_file.name}: refusing to create symlink '{file_patch.path}' (series may not add links)"
                )
        patches.append(patch)
    return tuple(patches)


def plan_series(
    series: Series, tree: TreeReader, *, max_fuzz: int = 0, patches: tuple[Patch, ...] | None = None,
    memo: dict | None = None,
) -> SeriesPlan:
    """Apply a series in memory, each patch on top of the previous ones; stop at the first failure.
    ``memo`` (a dict kept across calls on the same parsed ``patches``, as drift keeps it over many
    commits) reuses a patch's result wherever the files it touches have the same bytes."""
    parsed = patches if patches is not None else load_patches(series)
    overlay: dict[str, bytes | None] = {}
    read = _overlay_reader(tree, overlay)
    plans: list[PatchPlan] = []
    for patch in parsed:
        skip_reason = _skip_reason(patch, series, tree)
        if skip_reason:
            plans.append(PatchPlan(patch.name, patch.subject, SKIPPED, None, skip_reason))
            continue
        result = _apply(patch, read, max_fuzz, memo)
        plans.append(PatchPlan(patch.name, patch.subject, result.status, result))
        if result.status == "failed":
            break
        overlay.update(result.changes)
    return SeriesPlan(series=series, patches=tuple(plans), parsed=parsed)


def _apply(patch: Patch, read: Callable[[str], bytes | None], max_fuzz: int, memo: dict | None) -> PatchResult:
    """The engine's result, remembered by the patch (its parsed object) and its files' blob ids."""
    if memo is None:
        return apply_patch(patch, read, max_fuzz=max_fuzz)
    touched = sorted({p for f in patch.files for p in (f.old_path, f.new_path) if p})
    contents = [read(path) for path in touched]
    key = (id(patch), max_fuzz, tuple(None if c is None else git_blob_id(c) for c in contents))
    if key not in memo:
        memo[key] = apply_patch(patch, read, max_fuzz=max_fuzz)
    return memo[key]


def _overlay_reader(tree: TreeReader, overlay: dict[str, bytes | None]) -> Callable[[str], bytes | None]:
    def read(path: str) -> bytes | None:
        if path in overlay:
            return overlay[path]
        return tree.read(path)

    return read


def _skip_reason(patch: Patch, series: Series, tree: TreeReader) -> str:
    """A patch is skipped only when all its files sit in optional folders (or files) the tree lacks.

    PyPI's megatron-core holds megatron/core alone; the training and legacy patches of a series
    have nothing to change there. Any other missing file is a real failure, never a skip.
    """
    folders = set()
    for file_patch in patch.files:
        folder = next((o for o in series.optional if _under(file_patch.path, o.rstrip("/"))), None)
        if folder is None:
            return ""
        folders.add(folder)
    missing = sorted(f for f in folders if not tree.exists(f))
    if len(missing) != len(folders):
        return ""
    return f"tree has no {', '.join(missing)}"


def _under(path: str, optional: str) -> bool:
    """An optional entry is a folder (everything inside it) or one file."""
    return path == optional or path.startswith(optional + "/")
