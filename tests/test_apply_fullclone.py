"""Against a full upstream clone (MEGAPORT_UPSTREAM_CLONE; skipped otherwise): every era.

Every release tag from v2.0 through core_v0.19.0, upstream main at its newest commit, and a sample
of untagged main-branch commits spread over 2021-2026 (picked here from the history) must port
with one `megaport apply --ref <commit>`: automatic selection, no fuzz. Each tagged tree is then
imported and its softmax compared with an fp64 reference of that era's kernels, where upstream's
own dependencies import on this machine.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
from pathlib import Path

import pytest
from support.porting import assert_clean, assert_kernel_semantics, check_tree, port, semantics_of

pytestmark = pytest.mark.fullclone

RELEASE_PATTERNS = ("v2.*", "2[0-9].0[0-9]", "core_v*", "core_r*", "v0.*")
SAMPLE_SIZE = 24
SAMPLE_SINCE = "2021-01-13"  # the day after v2.0


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def release_tags(repo: Path) -> list[str]:
    """Release tags from v2.0 on, oldest first; release candidates and project tags left out."""
    tags = []
    for line in git(repo, "for-each-ref", "--sort=creatordate", "--format=%(refname:short)", "refs/tags").split():
        name = line.removeprefix("tags/")
        if any(fnmatch.fnmatch(name, p) for p in RELEASE_PATTERNS) and "rc" not in name and name != "v1.0":
            tags.append(name)
    return tags


def sampled_main_commits(repo: Path) -> list[tuple[str, str]]:
    """Untagged first-parent main commits evenly spread in time from v2.0 to the newest."""
    history = [line.split() for line in git(repo, "log", "--first-parent", "--format=%H %cs %ct",
                                            f"--since={SAMPLE_SINCE}", "main").splitlines()]
    history.reverse()
    tagged = {sha for sha in git(repo, "for-each-ref", "--format=%(objectname) %(*objectname)", "refs/tags").split()}
    candidates = [(sha, day, int(ts)) for sha, day, ts in history if sha not in tagged]
    first, last = candidates[0][2], candidates[-1][2]
    picks, index = [], 0
    for step in range(SAMPLE_SIZE):
        target = first + (last - first) * step / (SAMPLE_SIZE - 1)
        while index < len(candidates) - 1 and candidates[index][2] < target:
            index += 1
        if not picks or picks[-1][0] != candidates[index][0]:
            picks.append(candidates[index][:2])
    return picks


@pytest.fixture(scope="module")
def clone(full_clone) -> Path:
    return full_clone


def release_params():
    location = os.environ.get("MEGAPORT_UPSTREAM_CLONE")
    if not location or not Path(location).exists():
        return ["(no clone)"]
    return release_tags(Path(location)) + ["main"]


@pytest.mark.parametrize("ref", release_params())
def test_release_ports_with_no_fuzz_and_era_kernels(ref, clone, tmp_path, fake_cuda_modules):
    dest = tmp_path / "ported"
    code, report, output = port(clone, ref, dest)
    assert code == 0, output
    assert_clean(report)
    source = "\n".join(p.read_text() for p in dest.glob("megatron/**/*.py") if "rccl" in p.read_text())
    assert "resolve_distributed_backend" in source  # the init path resolves rccl
    pytest.importorskip("torch")
    semantics = semantics_of(report["series"])
    found = check_tree(dest, fake_cuda_modules, semantics)
    if "missing_dependency" in found:
        pytest.skip(f"applied cleanly; importing needs upstream's dependency {found['missing_dependency']}")
    assert_kernel_semantics(found, semantics)


def test_sampled_untagged_main_commits_port(clone, tmp_path):
    sample = sampled_main_commits(clone)
    assert len(sample) >= 20
    years = {day[:4] for _, day in sample}
    assert {"2021", "2022", "2023", "2024", "2025", "2026"} <= years
    failures = []
    for sha, day in sample:
        code, report, output = port(clone, sha, tmp_path / sha[:10], "--dry-run")
        if code != 0:
            failures.append(f"{sha[:10]} ({day}): {output.strip().splitlines()[-1] if output.strip() else code}")
            continue
        assert_clean(report)
    assert not failures, "\n".join(failures)


def test_stanford_megatron_ports(tmp_path, fake_cuda_modules):
    """stanford-futuredata/Megatron-LM (the tree ROCm ships): upstream 2023-01 plus MoE commits."""
    location = os.environ.get("MEGAPORT_STANFORD_CLONE")
    if not location:
        pytest.skip("set MEGAPORT_STANFORD_CLONE to a stanford-futuredata/Megatron-LM clone to run this")
    dest = tmp_path / "stanford"
    code, report, output = port(Path(location), "85f95ae", dest)
    assert code == 0, output
    assert report["series"].startswith("e3-")
    assert_clean(report)
    pytest.importorskip("torch")
    found = check_tree(dest, fake_cuda_modules, semantics_of(report["series"]))
    assert_kernel_semantics(found, semantics_of(report["series"]))


def test_every_tested_ref_in_the_catalogue_is_chosen_and_applies(clone, tmp_path):
    """The catalogue's promise: each series is chosen for, and applies with no fuzz to, every ref it lists.
    Forks' series list refs of their fork: tests/test_deepspeed_fullclone.py checks those."""
    from megaport.catalogue import load_catalogue

    failures = []
    for series in (s for s in load_catalogue().series if s.is_upstream):
        for tested in series.tested:
            code, report, output = port(clone, tested.sha or tested.ref, tmp_path / "d", "--dry-run")
            if code != 0 or report.get("series") != series.name:
                failures.append(f"{series.name} @ {tested.label}: got {report.get('series')} ({code})")
                continue
            assert_clean(report)
    assert not failures, "\n".join(failures)
