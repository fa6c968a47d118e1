"""Where did a file go? For hunks whose file upstream no longer has.

1. git's own rename detection (``git diff --find-renames``) between a commit that still has the
   file and the checked commit. Such commits: the series' tested shas that the repository holds,
   and the other refs of the same drift run; the one committed nearest before the checked commit
   is asked, so the diff is short (rename detection compares every deleted file with every added
   one: between commits years apart that is thousands of files, per checked ref). Where the file
   went from that commit is remembered: later refs where it is still there need no diff.
2. Failing that, a search of the checked tree for files with the same name, scored by how
   similar they are to the preimage (or, without one, to the hunks' old lines).
"""

from __future__ import annotations

import bisect
import difflib
import itertools
import posixpath
from pathlib import Path
from typing import Iterable, Optional

from megaport.engine.blob import git_blob_id
from megaport.git import ObjectReader, ls_tree_paths, renamed_paths

#: A same-name file must be at least this similar to count as the moved file.
MIN_SIMILARITY = 0.5


class MoveFinder:
    """Finds likely new paths in commit ``sha`` of ``repo``; caches git's answers per run."""

    def __init__(self, repo: Path, objects: ObjectReader, bases: Iterable[str] = ()) -> None:
        self.repo = repo
        self.objects = objects
        self.bases = list(dict.fromkeys(bases))
        self._renames: dict[tuple[str, str], dict[str, Optional[str]]] = {}
        self._went: dict[tuple[str, str], str] = {}
        self._files: dict[str, dict[str, list[str]]] = {}
        self._holding: dict[str, list[tuple[int, int, str]]] = {}
        self._located: dict[tuple[str, str, Optional[str]], tuple[Optional[str], str]] = {}
        self._ratios: dict[tuple[str, Optional[str]], float] = {}

    def finder(self, sha: str):
        """A ``locate_moved(path, preimage)`` callable for ``check_series`` on ``sha``."""

        def locate(path: str, preimage: Optional[bytes]) -> tuple[Optional[str], str]:
            return self.locate(sha, path, preimage)

        return locate

    def add_base(self, sha: str) -> None:
        """One more commit that may still have missing files (just fetched)."""
        if sha not in self.bases:
            self.bases.append(sha)
            self._holding.clear()
            self._located.clear()

    def has_base(self, path: str, sha: str) -> bool:
        """True when a commit other than ``sha`` is known to have ``path``."""
        return self._base_holding(path, sha) is not None

    def locate(self, sha: str, path: str, preimage: Optional[bytes]) -> tuple[Optional[str], str]:
        """``(new path or None, what happened)`` for ``path``, absent from ``sha``."""
        wanted = git_blob_id(preimage) if preimage is not None else None
        key = (sha, path, wanted)
        if key not in self._located:
            self._located[key] = self._locate(sha, path, preimage, wanted)
        return self._located[key]

    def _locate(
        self, sha: str, path: str, preimage: Optional[bytes], wanted: Optional[str]
    ) -> tuple[Optional[str], str]:
        base = self._base_holding(path, sha)
        if base is not None:
            went = self._went.get((base, path))
            if went is not None and self._blob_id(sha, went) is not None:
                renames = {path: went}  # it went there from base, and it is still there
            else:
                renames = self._rename_map(base, sha)
            if path in renames:
                new = renames[path]
                if new is not None:
                    self._went[(base, path)] = new
                    return new, f"file was renamed to {new} (git rename detection from {base[:12]})"
                found = self._same_name(sha, path, preimage, wanted)
                if found:
                    return found[0], f"file was deleted; {_similar(*found)}"
                return None, "file was deleted upstream"
        found = self._same_name(sha, path, preimage, wanted)
        if found:
            return found[0], f"file is gone; {_similar(*found)}"
        return None, "file does not exist upstream"

    def _base_holding(self, path: str, sha: str) -> Optional[str]:
        """The commit other than ``sha`` that has ``path`` and was committed nearest before ``sha``
        (else nearest after): the shortest diff to ask git's rename detection."""
        if path not in self._holding:
            held = [base for base in self.bases if self._blob_id(base, path) is not None]
            self._holding[path] = sorted((self.objects.commit_time(base) or 0, -n, base) for n, base in enumerate(held))
        holding = self._holding[path]
        when = self.objects.commit_time(sha) or 0
        at = bisect.bisect_right(holding, (when, 1, ""))  # the first of those committed after sha
        nearest_first = itertools.chain(range(at - 1, -1, -1), range(at, len(holding)))
        return next((holding[i][2] for i in nearest_first if holding[i][2] != sha), None)

    def _blob_id(self, commit: str, path: str) -> Optional[str]:
        """The blob at ``path`` in ``commit``, through the reader's tree cache."""
        return self.objects.tree(commit).blob_id(path)

    def _rename_map(self, base: str, sha: str) -> dict[str, Optional[str]]:
        """Old path -> new path (renamed) or None (deleted), from base to sha."""
        key = (base, sha)
        if key not in self._renames:
            self._renames[key] = renamed_paths(self.repo, base, sha)
        return self._renames[key]

    def _same_name(
        self, sha: str, path: str, preimage: Optional[bytes], wanted: Optional[str]
    ) -> Optional[tuple[str, Optional[float]]]:
        """The most similar file of ``sha`` with the same name (without a preimage to compare
        with: the only one), and how similar it is."""
        if sha not in self._files:
            by_name: dict[str, list[str]] = {}
            for candidate in ls_tree_paths(self.repo, sha):
                by_name.setdefault(posixpath.basename(candidate), []).append(candidate)
            self._files[sha] = by_name
        candidates = [p for p in self._files[sha].get(posixpath.basename(path), []) if p != path]
        if not candidates or preimage is None:
            return (candidates[0], None) if len(candidates) == 1 and preimage is None else None
        scored = []
        for candidate in candidates:
            blob = self._blob_id(sha, candidate)
            if blob is None:
                continue
            key = (blob, wanted)
            if key not in self._ratios:
                self._ratios[key] = _ratio(preimage, self.objects.blob(blob) or b"")
            scored.append((self._ratios[key], -abs(len(candidate) - len(path)), candidate))
        if not scored:
            return None
        ratio, _, best = max(scored)
        return (best, ratio) if ratio >= MIN_SIMILARITY else None


def _ratio(preimage: bytes, data: bytes) -> float:
    """How alike two files are, by lines (difflib; 0..1)."""
    wanted = preimage.decode("utf-8", "replace").splitlines()
    lines = data.decode("utf-8", "replace").splitlines()
    matcher = difflib.SequenceMatcher(None, wanted, lines, autojunk=False)
    return matcher.ratio() if matcher.quick_ratio() >= MIN_SIMILARITY else matcher.quick_ratio()

def _similar(path: str, ratio: Optional[float]) -> str:
    if ratio is None:
        return f"{path} has the same name"
    return f"{path} has the same name and is {ratio:.0%} similar"
