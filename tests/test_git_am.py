"""The series' promise without megaport: `git am` of a series' listed patches, run by hand with the
one-liner the docs give, on a clone at a tested ref, makes the tree `megaport apply` makes.

One series per [[port]] variant: on the PyPI-built upstream (megatron/core only, so the patches
megaport skips there are left out of the list), and on full clones when MEGAPORT_UPSTREAM_CLONE
and MEGAPORT_DEEPSPEED_CLONE name them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.porting import port

from megaport.catalogue import COMMON_DIRS, LIST_FILE, load_catalogue, read_list

ROOT = Path(__file__).resolve().parents[1]
# What docs/series-format.md and README.md tell users to run, with S the series folder.
GIT_AM = """git am $(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' -e "s|^[[:space:]]*|$S/|" "$S/series")"""


def test_the_docs_give_this_one_liner():
    for doc in ("docs/series-format.md", "README.md"):
        assert GIT_AM in (ROOT / doc).read_text(), doc


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def git_am_tree(repo: Path, ref: str, series_dir: Path, work: Path) -> str:
    """Check ``ref`` out of ``repo`` and run the one-liner there; the tree git am leaves."""
    clone = work / "by-hand"
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(clone)], check=True)
    git(clone, "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", git(repo, "rev-parse", f"{ref}^{{commit}}"))
    env = dict(os.environ, S=str(series_dir), GIT_COMMITTER_NAME="by hand", GIT_COMMITTER_EMAIL="by-hand@localhost",
               GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    proc = subprocess.run(["bash", "-c", GIT_AM], cwd=clone, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert git(clone, "status", "--porcelain") == ""
    return git(clone, "rev-parse", "HEAD^{tree}")


def check_series(repo: Path, series_name: str, ref: str, work: Path) -> None:
    series = load_catalogue().get(series_name)
    dest = work / "ported"
    code, report, output = port(repo, ref, dest)
    assert code == 0, output
    assert report["series"] == series_name
    skipped = {p["name"] for p in report["patches"] if p["status"] == "skipped"}
    series_dir = series.directory
    if skipped:
        # The tree lacks the folders these patches change (PyPI's megatron/core alone): a copy of
        # the catalogue whose list leaves them out, as a user porting such a tree would.
        copy = work / "patches"
        for common in COMMON_DIRS:
            shutil.copytree(series.directory.parent / common, copy / common)
        shutil.copytree(series.directory, copy / series_name)
        kept = [entry for _, entry, patch in read_list(series.directory) if patch.name not in skipped]
        (copy / series_name / LIST_FILE).write_text("".join(f"{entry}\n" for entry in kept))
        series_dir = copy / series_name
    assert git_am_tree(repo, ref, series_dir, work) == git(dest, "rev-parse", "HEAD^{tree}")
    ported_commits = int(git(dest, "rev-list", "--count", "refs/megaport/upstream..HEAD"))
    assert ported_commits == len(series.patches) - len(skipped)


@pytest.mark.upstream
@pytest.mark.parametrize("series_name, ref", [
    ("core-0.13-0.16", "core_v0.16.1"),  # port core-zero-guarded
    ("core-0.4-0.5", "core_v0.5.0"),     # port core-zero-unguarded
])
def test_git_am_by_hand_gives_apply_s_tree_on_pypi_upstream(core_upstream, series_name, ref, tmp_path):
    check_series(core_upstream, series_name, ref, tmp_path)


FULL_CLONE = [
    ("MEGAPORT_UPSTREAM_CLONE", "core-0.13-0.16"),   # core-zero-guarded
    ("MEGAPORT_UPSTREAM_CLONE", "e4-2023-07"),       # core-zero-unguarded
    ("MEGAPORT_UPSTREAM_CLONE", "e1-v2.0"),          # megatron-uniform-guarded
    ("MEGAPORT_UPSTREAM_CLONE", "e2-2022-zero-rows"),  # megatron-zero-guarded
    ("MEGAPORT_DEEPSPEED_CLONE", "mds-2024-12"),     # megatron-zero-guarded, the fork
]


def test_the_full_clone_cases_cover_every_port_variant():
    catalogue = load_catalogue()
    assert {catalogue.get(name).port for _, name in FULL_CLONE} == {v.name for v in catalogue.ports}


@pytest.mark.fullclone
@pytest.mark.parametrize("variable, series_name", FULL_CLONE)
def test_git_am_by_hand_gives_apply_s_tree_on_a_full_clone(variable, series_name, tmp_path):
    location = os.environ.get(variable)
    if not location or not Path(location).exists():
        pytest.skip(f"set {variable} to a full clone to run this")
    tested = load_catalogue().get(series_name).tested[-1]
    check_series(Path(location), series_name, tested.sha or tested.ref, tmp_path)
