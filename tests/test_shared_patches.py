"""A patch several series carry is stored once (patches/shared/), as the port package is (port/):
regenerate writes it so, lint fails on two copies, patches/ stays within the line budget issue 40
set, and `git am` of a series following its list gives the tree it gave when each series held its
own copy."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.catalogues import write_catalogue
from test_git_am import git, git_am_tree

from megaport.catalogue import LIST_FILE, PORT_DIR, SHARED_DIR, list_entries, load_catalogue
from megaport.cli import main
from megaport.regenerate import with_range_trailers

ROOT = Path(__file__).resolve().parents[1]
# Issue 40: "patches/ stays under 17,583 lines" (a quarter of the 70,333 its .patch files had before
# the port package was stored once), counted as the issue counted its 20,139:
#   find patches -name '*.patch' -print0 | xargs -0 cat | wc -l
LINE_BUDGET = 17_583
# This repository's last commit before patches were shared: each series held its own copy.
BEFORE_SHARING = "adfc879ec9927aea0fd223329d0a355cba8a3431"


def patch_lines(root: Path) -> int:
    """Newline count of every .patch file under ``root``, as ``xargs cat | wc -l`` gives it."""
    return sum(path.read_bytes().count(b"\n") for path in root.rglob("*.patch"))


def test_patches_stay_within_the_line_budget():
    lines = patch_lines(ROOT / "patches")
    assert lines <= LINE_BUDGET, f"patches/ holds {lines} lines of patches, over issue 40's {LINE_BUDGET}"


def test_no_two_shipped_patch_files_hold_the_same_patch():
    """Byte for byte, and but for the range trailers that legitimately differ per series."""
    files = [p for p in sorted((ROOT / "patches").rglob("*.patch")) if p.parts[-3] != PORT_DIR]
    exact = [p.read_bytes() for p in files]
    assert len(set(exact)) == len(exact)
    bodies = [with_range_trailers(data, []) for data in exact]
    twins = [(a.relative_to(ROOT), b.relative_to(ROOT)) for i, a in enumerate(files) for j, b in enumerate(files)
             if i < j and bodies[i] == bodies[j]]
    assert not twins


def test_shipped_shared_patches_are_listed_by_several_series_and_name_each_range():
    catalogue = load_catalogue(ROOT / "patches")
    listers: dict[Path, list] = {}
    for series in catalogue.series:
        for patch in series.patches:
            if patch.shared:
                listers.setdefault(patch.path, []).append(series)
    assert set(listers) == set((ROOT / "patches" / SHARED_DIR).glob("*/*.patch"))
    for path, series in listers.items():
        assert len(series) >= 2 and path.parent.name == series[0].name, path
        text = path.read_text()
        for one in series:
            first, last = one.tested[0].label, one.tested[-1].label
            assert f"Upstream-Range: {first}..{last}\n" in text, (path, one.name)


PATCH = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: megaport <megaport@localhost>
Date: Sun, 22 Nov 2026 00:00:00 +0000
Subject: [PATCH] Change {what}

Because the test says so.

Upstream-Range: {range}

diff --git a/a.py b/a.py
index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644
--- a/a.py
+++ b/a.py
@@ -1 +1 @@
-{what} = 1
+{what} = 2
"""


def two_series(root: Path) -> Path:
    """Series 'one' and 'two' with the same second patch (each with its own range), and a patch
    of their own first."""
    write_catalogue(root, {"0001-own.patch": PATCH.format(what="x", range="v1..v2"),
                           "0002-same.patch": PATCH.format(what="y", range="v1..v2")}, name="one",
                    entry='era = "t"\nsummary = "d"\ntested = [{ ref = "v1" }, { ref = "v2" }]\n')
    (root / "two").mkdir()
    (root / "two" / "0001-own.patch").write_text(PATCH.format(what="z", range="v3..v3"))
    (root / "two" / "0004-same.patch").write_text(PATCH.format(what="y", range="v3..v3"))
    (root / "two" / "series").write_text("# two's own first\n0001-own.patch\n0004-same.patch  # the shared one\n")
    with (root / "catalogue.toml").open("a") as handle:
        handle.write('\n[[series]]\nname = "two"\nera = "t"\nsummary = "d"\ntested = [{ ref = "v3" }]\n')
    return root


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_lint_fails_on_two_copies_and_regenerate_stores_one(tmp_path):
    root = two_series(tmp_path / "cat")
    linted = run("lint", "--patches", str(root))
    assert linted.exit_code == 1
    assert "two/0004-same.patch: the same patch as one/0002-same.patch but for its 'Upstream-Range'" in linted.output
    assert run("regenerate", "--check", "--patches", str(root)).exit_code == 1

    assert run("regenerate", "--patches", str(root)).exit_code == 0
    shared = root / SHARED_DIR / "one" / "0002-same.patch"
    assert sorted(p.name for p in (root / "one").iterdir()) == ["0001-own.patch", "series"]
    assert sorted(p.name for p in (root / "two").iterdir()) == ["0001-own.patch", "series"]
    assert "Upstream-Range: v1..v2\nUpstream-Range: v3..v3\n\ndiff --git" in shared.read_text()
    assert (root / "two" / "series").read_text() == (
        "# two's own first\n0001-own.patch\n../shared/one/0002-same.patch  # the shared one\n")
    catalogue = load_catalogue(root)
    assert [p.path for p in catalogue.get("one").patches][1] == [p.path for p in catalogue.get("two").patches][1] == shared
    assert run("lint", "--patches", str(root)).exit_code == 0
    assert run("regenerate", "--check", "--patches", str(root)).exit_code == 0


def test_a_shared_patch_one_series_changes_goes_back_to_each_series(tmp_path):
    root = two_series(tmp_path / "cat")
    assert run("regenerate", "--patches", str(root)).exit_code == 0
    shared = root / SHARED_DIR / "one" / "0002-same.patch"
    # A series that needs another change takes its own copy (as refresh writes it) ...
    (root / "two" / "0002-same.patch").write_text(shared.read_text().replace("+y = 2", "+y = 3"))
    (root / "two" / "series").write_text((root / "two" / "series").read_text().replace("../shared/one/", ""))
    assert run("lint", "--patches", str(root)).output.count("listed by one alone") == 1
    # ... and regenerate moves the other back into its own folder, with its range alone.
    assert run("regenerate", "--patches", str(root)).exit_code == 0
    assert not (root / SHARED_DIR).exists()
    assert (root / "one" / "series").read_text() == "0001-own.patch\n0002-same.patch\n"
    assert "Upstream-Range: v1..v2\n\ndiff" in (root / "one" / "0002-same.patch").read_text()
    assert "Upstream-Range: v3..v3\n\ndiff" in (root / "two" / "0002-same.patch").read_text()
    assert run("lint", "--patches", str(root)).exit_code == 0


def test_a_list_entry_outside_the_shared_places_is_refused(tmp_path):
    root = two_series(tmp_path / "cat")
    (root / "two" / "series").write_text("../one/0002-same.patch\n")
    result = run("series", "--patches", str(root))
    assert result.exit_code == 2 and "list entry '../one/0002-same.patch' must be a file in" in result.output
    assert len(result.output.strip().splitlines()) == 1


# --- git am: the same trees as when each series held its own copies ---------------------------------

# (variable naming the clone, series): every port variant, and series that share the most.
SAMPLE = [
    ("MEGAPORT_UPSTREAM_CLONE", "core-0.13-0.16"),     # core-zero-guarded
    ("MEGAPORT_UPSTREAM_CLONE", "core-0.11"),          # core-0.10-0.12's then (RENAMED)
    ("MEGAPORT_UPSTREAM_CLONE", "e4-2023-07"),         # core-zero-unguarded
    ("MEGAPORT_UPSTREAM_CLONE", "e1-v2.0"),            # megatron-uniform-guarded
    ("MEGAPORT_UPSTREAM_CLONE", "e2-2022-zero-rows"),  # megatron-zero-guarded
    ("MEGAPORT_UPSTREAM_CLONE", "e6-2024-07-30"),
    ("MEGAPORT_DEEPSPEED_CLONE", "mds-2023-07"),       # the fork
    ("MEGAPORT_DEEPSPEED_CLONE", "mds-2024-12"),
]


#: sample series split off a series of BEFORE_SHARING since, and that series' name then
RENAMED = {"core-0.11": "core-0.10-0.12"}


def before_sharing(series: str, target: Path) -> Path:
    """The series folder as of BEFORE_SHARING (under its name then, :data:`RENAMED`), beside
    today's port/ (so the port package's later edits are in both trees), and the patches the series
    has listed after its last entry since, copied in (a patch a series gained later is in both
    trees); skips where this checkout has no such history."""
    then_name = RENAMED.get(series, series)
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE_SHARING}:patches/{then_name}/series"],
                           capture_output=True)
    if probe.returncode:
        pytest.skip(f"this checkout has no commit {BEFORE_SHARING} (the series before sharing)")
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE_SHARING, f"patches/{then_name}"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target), "--strip-components=1"], input=archive, check=True)
    shutil.copytree(ROOT / "patches" / PORT_DIR, target / PORT_DIR)
    folder = target / then_name
    then = list_entries(folder / LIST_FILE)
    for _, entry in list_entries(ROOT / "patches" / series / LIST_FILE)[len(then):]:
        shutil.copy(ROOT / "patches" / series / entry, folder / Path(entry).name)
        with open(folder / LIST_FILE, "a") as listing:
            listing.write(Path(entry).name + "\n")
    return folder


@pytest.mark.fullclone
@pytest.mark.parametrize("variable, series_name", SAMPLE)
def test_git_am_gives_the_tree_each_series_gave_with_its_own_copies(variable, series_name, tmp_path):
    location = os.environ.get(variable)
    if not location or not Path(location).exists():
        pytest.skip(f"set {variable} to a full clone to run this")
    series = load_catalogue().get(series_name)
    assert any(p.shared for p in series.patches), "a sample series that shares nothing proves nothing"
    tested = series.tested[-1]
    ref = tested.sha or tested.ref
    old = before_sharing(series_name, tmp_path / "before")
    assert not any(line.startswith(f"../{SHARED_DIR}/") for line in (old / "series").read_text().splitlines())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    now = git_am_tree(Path(location), ref, series.directory, tmp_path / "a")
    assert now == git_am_tree(Path(location), ref, old, tmp_path / "b")
    assert git(tmp_path / "a" / "by-hand", "rev-list", "--count", f"{ref}..HEAD") == str(len(series.patches))


def test_a_shared_patch_listed_twice_is_refused(tmp_path):
    root = two_series(tmp_path / "cat")
    assert run("regenerate", "--patches", str(root)).exit_code == 0
    with (root / "two" / "series").open("a") as handle:
        handle.write("../shared/one/0002-same.patch\n")
    assert "two/series:4: '../shared/one/0002-same.patch' is listed twice" in run("lint", "--patches", str(root)).output
    result = run("series", "--patches", str(root))
    assert result.exit_code == 2 and "names ../shared/one/0002-same.patch twice" in result.output
