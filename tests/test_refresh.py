"""`megaport refresh`: rebuild a series on a drifted ref, deterministically, or write nothing.

Uses the drifted upstream of test_drift (tags s_offset, s_fuzz, s_3way, ...) and, for the real
series, the PyPI-built upstream (core_v0.13.0 … core_v0.16.1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.catalogues import copy_shipped
from support.gitrepos import commit, git
from test_drift import PATCHES, drift_json, hunks_of
from test_drift import catalogue, upstream  # noqa: F401  (the same fixtures: one drifting upstream)

from megaport.catalogue import load_catalogue
from megaport.cli import main
from megaport.engine import parse_patch
from megaport.engine.blob import git_blob_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib



def refresh(*args: str):
    return CliRunner().invoke(main, ["refresh", *args])


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_refresh_as_new_series_rebuilds_moved_hunks_and_appends_the_entry(upstream, catalogue):
    repo = upstream[0]
    before = snapshot(catalogue)
    result = refresh("--repo", str(repo), "--patches", str(catalogue), "--series", "demo", "--ref", "s_offset",
                     "--as", "demo-next")
    assert result.exit_code == 0, result.output
    after = snapshot(catalogue)
    # The old series is untouched; the catalogue only grew at its end.
    assert {k: v for k, v in after.items() if k.startswith("demo/")} == {k: v for k, v in before.items() if k.startswith("demo/")}
    assert after["catalogue.toml"].startswith(before["catalogue.toml"])
    # Clean patches keep every byte; the moved one is regenerated with 3 lines of context.
    for name in ("0002-b.patch", "0003-c.patch", "0004-d.patch", "0005-e.patch", "series"):
        assert after[f"demo-next/{name}"] == before[f"demo/{name}"], name
    new = after["demo-next/0001-a.patch"].decode()
    old = before["demo/0001-a.patch"].decode()
    assert new.split("diff --git")[0] == old.split("diff --git")[0]  # mail header and message kept
    assert "@@ -22,7 +22,7 @@" in new
    a_at_ref = git(repo, "show", "s_offset:megatron/core/a.py") + "\n"
    assert f"index {git_blob_id(a_at_ref.encode())}.." in new
    # The new entry: a copy of the old one, tested on the ref.
    series = load_catalogue(catalogue).get("demo-next")
    assert [(t.ref, t.sha) for t in series.tested] == [("s_offset", git(repo, "rev-parse", "s_offset"))]
    assert series.era == "test" and series.optional == ("megatron/training",)
    assert series.recognise.core_min == (0, 13, 0) and series.recognise.core_max == (0, 17, 0)
    # And it is clean on the ref it was refreshed for.
    code, report = drift_json(repo, catalogue, "s_offset", extra=("--series", "demo-next"))
    assert code == 0, report


@pytest.mark.parametrize("ref", ["s_fuzz", "s_3way", "s_applied"])
def test_refresh_in_place_makes_the_series_clean_on_the_ref(upstream, catalogue, ref):
    repo = upstream[0]
    code, _ = drift_json(repo, catalogue, ref)
    assert code == 2  # apply refuses each: fuzz, a merge, half the patch upstream's
    result = refresh("--repo", str(repo), "--patches", str(catalogue), "--series", "demo", "--ref", ref, "--in-place")
    assert result.exit_code == 0, result.output
    code, report = drift_json(repo, catalogue, ref)
    assert code == 0, report
    assert "tested of demo" in result.stdout  # says what to add to the catalogue; does not edit it


def test_refresh_after_a_three_way_merge_keeps_both_changes(upstream, catalogue):
    repo = upstream[0]
    refresh("--repo", str(repo), "--patches", str(catalogue), "--series", "demo", "--ref", "s_3way", "--in-place")
    patch = parse_patch((catalogue / "demo" / "0002-b.patch").read_text())
    (hunk,) = patch.files[0].hunks
    old_side = [text for kind, text in hunk.lines if kind != "+"]
    assert "beta_12 = 'twelve'" in old_side  # upstream's edit is now context
    assert ("+", "beta_10 = 'ten'") in hunk.lines and ("+", "beta_14 = 'fourteen'") in hunk.lines


def test_refresh_drops_the_hunk_upstream_already_has(upstream, catalogue):
    repo = upstream[0]
    refresh("--repo", str(repo), "--patches", str(catalogue), "--series", "demo", "--ref", "s_applied", "--in-place")
    patch = parse_patch((catalogue / "demo" / "0003-c.patch").read_text())
    (hunk,) = patch.files[0].hunks
    assert ("+", "gamma_35 = [35, 35]") in hunk.lines


def test_refresh_drops_a_patch_upstream_took_entirely(upstream, catalogue, tmp_path):
    clone = tmp_path / "ahead"
    git(tmp_path, "clone", "--quiet", str(upstream[0]), str(clone))
    commit(clone, {"megatron/core/d.py": PATCHES["0004-d.patch"][1]}, "upstream takes d", tag="took_d")
    result = refresh("--repo", str(clone), "--patches", str(catalogue), "--series", "demo", "--ref", "took_d",
                     "--as", "demo-d")
    assert result.exit_code == 0, result.output
    assert "0004-d.patch" not in (catalogue / "demo-d" / "series").read_text()
    assert not (catalogue / "demo-d" / "0004-d.patch").exists()
    code, _ = drift_json(clone, catalogue, "took_d", extra=("--series", "demo-d"))
    assert code == 0


def test_refresh_in_place_removes_a_dropped_patch_and_its_line(upstream, catalogue, tmp_path):
    clone = tmp_path / "ahead"
    git(tmp_path, "clone", "--quiet", str(upstream[0]), str(clone))
    commit(clone, {"megatron/core/d.py": PATCHES["0004-d.patch"][1]}, "upstream takes d", tag="took_d")
    result = refresh("--repo", str(clone), "--patches", str(catalogue), "--series", "demo", "--ref", "took_d",
                     "--in-place")
    assert result.exit_code == 0, result.output
    assert not (catalogue / "demo" / "0004-d.patch").exists()
    assert (catalogue / "demo" / "series").read_text().split() == [n for n in PATCHES if n != "0004-d.patch"]
    assert drift_json(clone, catalogue, "took_d")[0] == 0


def test_refresh_on_a_clean_ref_changes_no_byte(upstream, catalogue):
    repo = upstream[0]
    before = snapshot(catalogue)
    result = refresh("--repo", str(repo), "--patches", str(catalogue), "--series", "demo", "--ref", "s_clean", "--in-place")
    assert result.exit_code == 0, result.output
    assert snapshot(catalogue) == before
    result = refresh("--repo", str(repo), "--patches", str(catalogue), "--series", "demo", "--ref", "s_clean",
                     "--as", "same")
    assert result.exit_code == 0
    after = snapshot(catalogue)
    assert all(after[f"same/{name}"] == before[f"demo/{name}"] for name in [*PATCHES, "series"])


@pytest.mark.parametrize("ref", ["s_conflict", "s_deleted", "s_renamed"])
def test_refresh_that_cannot_work_lists_the_hunks_and_writes_nothing(upstream, catalogue, ref):
    before = snapshot(catalogue)
    result = refresh("--repo", str(upstream[0]), "--patches", str(catalogue), "--series", "demo", "--ref", ref,
                     "--as", "broken")
    assert result.exit_code == 2
    assert "hunk #1" in result.stdout and "nothing was written" in result.stderr
    assert snapshot(catalogue) == before


def test_refresh_without_a_destination_only_previews(upstream, catalogue):
    before = snapshot(catalogue)
    result = refresh("--repo", str(upstream[0]), "--patches", str(catalogue), "--series", "demo", "--ref", "s_offset")
    assert result.exit_code == 0
    assert "regenerated" in result.stdout and "preview" in result.stdout
    assert snapshot(catalogue) == before


@pytest.mark.parametrize(
    "args",
    [
        ("--series", "nope", "--ref", "v1", "--in-place"),
        ("--series", "demo", "--ref", "no-such-ref", "--in-place"),
        ("--series", "demo", "--ref", "v1", "--in-place", "--as", "x"),
        ("--series", "demo", "--ref", "s_offset", "--as", "demo"),
        ("--series", "demo", "--ref", "s_offset", "--as", "../escape"),
        ("--ref", "v1"),
    ],
)
def test_refresh_usage_errors_exit_3(upstream, catalogue, args):
    before = snapshot(catalogue)
    result = refresh("--repo", str(upstream[0]), "--patches", str(catalogue), *args)
    assert result.exit_code == 3, result.output
    assert snapshot(catalogue) == before


# --- the shipped series on real upstream code ----------------------------------------------


def shipped_copy(tmp_path: Path) -> Path:
    return copy_shipped(tmp_path / "patches")


@pytest.mark.upstream
def test_shipped_series_refresh_is_a_no_op_where_it_is_clean(core_upstream, tmp_path):
    patches = shipped_copy(tmp_path)
    before = snapshot(patches)
    result = refresh("--repo", str(core_upstream), "--patches", str(patches), "--series", "core-0.13-0.16",
                     "--ref", "core_v0.13.0", "--in-place")
    assert result.exit_code == 0, result.output
    assert snapshot(patches) == before


@pytest.mark.upstream
def test_shipped_series_refresh_on_a_later_release_is_clean_there(core_upstream, tmp_path):
    patches = shipped_copy(tmp_path)
    original = (patches / "catalogue.toml").read_bytes()
    result = refresh("--repo", str(core_upstream), "--patches", str(patches), "--series", "core-0.13-0.16",
                     "--ref", "core_v0.16.1", "--as", "core-0.16")
    assert result.exit_code == 0, result.output
    text = (patches / "catalogue.toml").read_bytes()
    assert text.startswith(original)
    entry = next(e for e in tomllib.loads(text.decode())["series"] if e["name"] == "core-0.16")
    assert entry["tested"] == [{"ref": "core_v0.16.1", "sha": git(core_upstream, "rev-parse", "core_v0.16.1")}]
    # The shared port patch, and the patches stored once in shared/, stay shared: the new list names
    # them where the old one did, and the folder holds no copy of them.
    assert entry["port"] == "core-zero-guarded"
    old_list = (patches / "core-0.13-0.16" / "series").read_text().splitlines()
    new_list = (patches / "core-0.16" / "series").read_text().splitlines()
    assert new_list[0] == old_list[0] and new_list[0].startswith("../port/base/")
    # (one the refresh rewrote is the new series' own copy, under its name in the series)
    names = [p.name for p in load_catalogue(patches).get("core-0.13-0.16").patches]
    assert all(new == old or (old.startswith("../shared/") and new == name)
               for old, new, name in zip(old_list, new_list, names, strict=True))
    assert sum(line.startswith("../shared/") for line in new_list) >= 1
    own = [line for line in new_list if not line.startswith("../")]
    assert sorted(p.name for p in (patches / "core-0.16").iterdir()) == sorted(own + ["series"])
    code, report = drift_json(core_upstream, patches, "core_v0.16.1", extra=("--series", "core-0.16"))
    assert code == 0, report
    hunks = hunks_of(report, "core_v0.16.1")
    assert all(h["status"] == "clean" for hs in hunks.values() for h in hs)
    # The patches it kept are core-0.13-0.16's: lint says so, and regenerate stores each once.
    linted = CliRunner().invoke(main, ["lint", "--patches", str(patches)])
    assert linted.exit_code == 1 and "run 'megaport regenerate' to store it once in shared/" in linted.output
    before = {p.name: p.path.read_bytes() for p in load_catalogue(patches).get("core-0.13-0.16").patches}
    rewritten = {name for name in own if (patches / "core-0.16" / name).read_bytes() != before[name]}
    assert CliRunner().invoke(main, ["regenerate", "--patches", str(patches)]).exit_code == 0
    # (a rewritten one may match yet another series' copy, and be shared too)
    assert {p.name for p in (patches / "core-0.16").iterdir()} <= rewritten | {"series"} and len(rewritten) < len(own)
    assert CliRunner().invoke(main, ["lint", "--patches", str(patches)]).exit_code == 0
