"""The run's settings (a :class:`Smoke`), and where conftest keeps them and the results on pytest's config.

Test modules read the settings at collection time (``metafunc.config.stash[SMOKE_KEY]``), before
any fixture exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megaport.smoke._era import Upstream
from megaport.smoke._locate import env_with_paths


@dataclass
class Smoke:
    """What every test needs to know about the run."""

    tree: Path
    device_kind: str
    fully_masked_rows_are_zero: bool
    series: str
    state: dict
    stand_ins: Path
    results: Path | None
    facts: dict = field(default_factory=dict)
    upstream: Upstream | None = None

    def era_has(self, path: str) -> bool:
        """Whether the tree's era has the file or directory ``path``: upstream's answer, the tree's
        only where upstream cannot be read (that fallback is reported as ``era_unverified``)."""
        found = self.upstream.has(path) if self.upstream is not None else None
        if found is None:
            found = (self.tree / path).exists()
            note = f"{path} taken as absent from the era, from the ported tree"
            unverified = self.facts.setdefault("era_unverified", [])
            if not found and note not in unverified:
                unverified.append(note)
        return found

    @property
    def gpu(self) -> bool:
        return self.device_kind != "cpu"

    def torch_device(self):
        import torch

        return torch.device("cuda", 0) if self.gpu else torch.device("cpu")

    def subprocess_env(self) -> dict:
        return env_with_paths(self.tree, self.stand_ins)


SMOKE_KEY = pytest.StashKey[Smoke]()
RESULTS_KEY = pytest.StashKey[dict]()
