"""Against a full upstream clone (MEGAPORT_UPSTREAM_CLONE; skipped otherwise): on upstream's other
lines, where drift used to say "applies" while apply refused (issue 40), drift exits at most 1
exactly where `megaport apply` ports, and with apply's own one-line reason where it refuses.

The refs: `dev` and two of its first-parent commits, two dated alpha branches, release branch
heads, and main with two of its first-parent commits. Those the clone lacks are left out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support.agreement import agreements
from support.porting import assert_clean, port

pytestmark = pytest.mark.fullclone

REFS = (
    "dev", "dev~40", "dev~300", "26.04-alpha", "25.09-alpha", "core_r0.19.0", "core_r0.18.0", "core_r0.16.0",
    "main", "main~25", "main~400",
)


def present(clone: Path) -> list[tuple[str, str]]:
    """(name, sha) of the refs of REFS that the clone has (neither command takes ``dev~40``)."""
    found = ((ref, subprocess.run(["git", "-C", str(clone), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
                                  capture_output=True, text=True)) for ref in REFS)
    return [(ref, run.stdout.strip()) for ref, run in found if run.returncode == 0]


def test_drift_and_apply_agree_on_upstreams_other_lines(full_clone, tmp_path):
    refs = present(full_clone)
    assert len(refs) >= 6
    found = agreements(full_clone, refs, tmp_path)
    disagreements = [f"{a.ref}: {a.problem}" for a in found if a.problem]
    assert not disagreements, "\n".join(disagreements)
    for refused in (a for a in found if not a.ports):
        check_fuzz_hint(full_clone, refused.sha, refused.apply_error, tmp_path)


def check_fuzz_hint(clone: Path, ref: str, error: str, tmp_path: Path) -> None:
    """A refusal that names --fuzz N is right: apply --fuzz N ports the tree with that series."""
    hint = re.search(r"--fuzz (\d) would port it with (\S+),", error)
    if hint is None:
        assert port(clone, ref, tmp_path / "fuzz3", "--dry-run", "--fuzz", "3")[0] != 0, (ref, error)
        return
    code, report, output = port(clone, ref, tmp_path / "fuzzN", "--dry-run", "--fuzz", hint.group(1))
    assert code == 0 and report["series"] == hint.group(2), output


@pytest.mark.parametrize("ref, series", [
    ("26.04-alpha", "core-0.17"), ("core_r0.19.0", "core-0.18-main"), ("main", "core-0.18-main"),
    ("dev", "core-0.19-dev"),
])
def test_other_lines_port_with_no_fuzz(full_clone, tmp_path, ref, series):
    """26.04-alpha sorted common_config.py's imports; the RCCL patch's import is anchored at
    DistributedInitConfig, not in that list, so it ports as release heads and main do. dev
    rewrote the RoPE-fusion check core-0.18-main changes: core-0.19-dev is its series."""
    code, report, output = port(full_clone, ref, tmp_path / "ported", "--dry-run")
    assert code == 0, output
    assert report["series"] == series
    assert_clean(report)
