"""tools/verify-eras --sampled: the commits inside the series' ranges that point at windows where a
family was broken (the parent of each upstream fix to a family's entry point, dataset or model),
each under the series apply picks for it. Against a full upstream clone (MEGAPORT_UPSTREAM_CLONE)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fullclone
TOOL = Path(__file__).resolve().parents[1] / "tools" / "verify-eras"


def test_the_t5_window_s_last_commit_is_sampled_under_the_series_that_ports_it(full_clone):
    listed = subprocess.run([sys.executable, str(TOOL), "--repo", str(full_clone), "--sampled", "--list",
                             "--series", "e7-2026-02"], capture_output=True, text=True, check=True).stdout
    rows = dict(line.split(None, 1) for line in listed.splitlines())
    # 9ddbce3aa2 "fix: T5 dataset" (2026-02-09): its parent still fails a T5 sample without masked spans
    assert rows["c072f894da96"].startswith("e7-2026-02@c072f894da (before 9ddbce3aa2, t5: fix: T5 dataset")
    assert rows["7a8f305f81b1"] == "e7-2026-02@oldest"
    assert all(label.startswith("e7-2026-02@") for label in rows.values())


def test_every_sampled_commit_since_v2_0_ports(full_clone):
    """A fix's parent apply refuses would be an ``unported@`` row (its result apply's error), not a
    gap in the list; on main since v2.0 there is none."""
    listed = subprocess.run([sys.executable, str(TOOL), "--repo", str(full_clone), "--sampled", "--list"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(listed) >= 130
    assert not [line for line in listed if "unported@" in line]


def test_only_picks_each_series_oldest_sampled_commit(full_clone):
    listed = subprocess.run([sys.executable, str(TOOL), "--repo", str(full_clone), "--sampled", "--list",
                             "--series", "e7-2026-02", "--only", "*@oldest"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert listed == ["7a8f305f81b1  e7-2026-02@oldest"]


def test_a_fix_spelled_inside_a_branch_name_is_sampled(full_clone):
    """b5836f82f6 "MLA_Fix" (2025-02-10) closed a window in which DeepSeek trained nothing; a word
    boundary before "fix" missed it, so no sample ever sat in the window."""
    listed = subprocess.run([sys.executable, str(TOOL), "--repo", str(full_clone), "--sampled", "--list",
                             "--series", "core-0.11"], capture_output=True, text=True, check=True).stdout
    assert "(before b5836f82f6, mla: Merge branch 'MLA_Fix'" in listed
