"""`megaport apply`/`status`/`series` on small synthetic upstreams with hand-made catalogues.

These pin the promises users rely on: a failing series writes nothing and says where it failed,
a dirty or foreign DEST is left alone, hostile series are refused before any write, and the
built-in catalogue is what `series` and `--patches` say it is.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.catalogues import DEMO_ENTRY, write_catalogue
from support.gitrepos import commit, git, make_repo

from megaport.cli import main

BASE = {
    "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 14\nPATCH = 0\n",
    "megatron/core/a.py": "".join(f"line {i}\n" for i in range(1, 31)),
    "megatron/core/b.py": "alpha\nbeta\ngamma\ndelta\n",
    "megatron/core/crlf.py": "one\r\ntwo\r\nthree\r\nfour\r\n",
}


def upstream(tmp_path: Path, files=BASE) -> Path:
    repo = tmp_path / "upstream"
    make_repo(repo, files, tag="v1")
    return repo


def diff_for(repo: Path, edits: dict[str, str], subject: str) -> str:
    """A real `git format-patch` of ``edits`` on top of the repo's HEAD (then undone)."""
    head = git(repo, "rev-parse", "HEAD")
    commit(repo, edits, subject)
    patch = git(repo, "format-patch", "--stdout", "--zero-commit", "--full-index", "--no-signature", "-1", "HEAD")
    git(repo, "reset", "--quiet", "--hard", head)
    return patch + "\n"


def catalogue(tmp_path: Path, patches: dict[str, str], *, name="demo", recognise="") -> Path:
    entry = DEMO_ENTRY + 'tested = [{ ref = "v1", sha = "" }]\n'
    return write_catalogue(tmp_path / "catalogue", patches, name=name, entry=entry, recognise=recognise)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def two_patches(tmp_path):
    repo = upstream(tmp_path)
    first = diff_for(repo, {"megatron/core/a.py": BASE["megatron/core/a.py"].replace("line 5\n", "line five\n")}, "first")
    second = diff_for(repo, {"megatron/core/crlf.py": "one\r\n2\r\nthree\r\nfour\r\n"}, "second")
    return repo, catalogue(tmp_path, {"0001-first.patch": first, "0002-second.patch": second})


def test_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("apply", "status", "series"):
        assert command in result.output


def test_apply_writes_one_commit_per_patch_and_keeps_crlf(tmp_path, two_patches):
    repo, patches = two_patches
    dest = tmp_path / "ported"
    result = invoke("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert result.exit_code == 0, result.output
    assert (dest / "megatron/core/crlf.py").read_bytes() == b"one\r\n2\r\nthree\r\nfour\r\n"
    assert "line five\n" in (dest / "megatron/core/a.py").read_text()
    assert git(dest, "log", "--format=%s", "-2").splitlines() == ["second", "first"]
    assert git(dest, "branch", "--show-current") == "megaport/demo"
    assert git(dest, "rev-parse", "refs/megaport/upstream") == git(repo, "rev-parse", "v1")
    assert git(dest, "remote", "get-url", "origin") == str(repo)


def test_patches_env_var_selects_the_catalogue(tmp_path, two_patches, monkeypatch):
    repo, patches = two_patches
    monkeypatch.setenv("MEGAPORT_PATCHES", str(patches))
    result = invoke("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(tmp_path / "d"), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "demo" in result.output and not (tmp_path / "d").exists()


def test_series_failing_halfway_writes_nothing_and_names_the_hunk(tmp_path, two_patches):
    repo, patches = two_patches
    # Upstream moves under the second patch: its context line 'three' is gone.
    commit(repo, {"megatron/core/crlf.py": "one\r\ntwo\r\nTHREE\r\nfour\r\n"}, "upstream moved", tag="v2")
    dest = tmp_path / "ported"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    report = tmp_path / "report.json"
    result = invoke("apply", "--ref", "v2", "--repo", str(repo), "--dest", str(dest / "sub"), "--patches",
                    str(patches), "--series", "demo", "--json", str(report))
    assert result.exit_code == 1
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("megaport: error: series demo does not apply")
    assert "0002-second.patch" in message and "megatron/core/crlf.py hunk #1" in message
    assert "nearest match at line 1" in message and "nothing was written" in message
    after = snapshot(tmp_path)
    after.pop("report.json")
    assert after == before
    assert not list(dest.parent.glob(".sub.megaport-*"))
    document = json.loads(report.read_text())
    assert document["status"] == "failed"
    assert [p["status"] for p in document["patches"]] == ["applied", "failed"]


def test_dirty_dest_is_refused_and_left_alone(tmp_path, two_patches):
    repo, patches = two_patches
    dest = tmp_path / "ported"
    args = ("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert invoke(*args).exit_code == 0
    (dest / "megatron/core/b.py").write_text("my local edit\n")
    before = snapshot(dest)
    result = invoke(*args)
    assert result.exit_code == 2
    assert "uncommitted changes" in result.stderr
    assert snapshot(dest) == before


def test_rerun_is_a_noop_and_status_sees_changes(tmp_path, two_patches):
    repo, patches = two_patches
    dest = tmp_path / "ported"
    args = ("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert invoke(*args).exit_code == 0
    head = git(dest, "rev-parse", "HEAD")
    again = invoke(*args)
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert git(dest, "rev-parse", "HEAD") == head
    assert invoke("status", str(dest), "--patches", str(patches)).exit_code == 0
    (dest / "megatron/core/a.py").write_text("changed\n")
    result = invoke("status", str(dest), "--patches", str(patches))
    assert result.exit_code == 1 and "megatron/core/a.py" in result.output


def test_foreign_nonempty_dest_is_refused(tmp_path, two_patches):
    repo, patches = two_patches
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    result = invoke("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert result.exit_code == 2 and "not a megaport tree" in result.stderr
    assert snapshot(dest) == {"notes.txt": b"keep me"}


def test_unknown_ref_and_missing_repo_are_one_line_errors(tmp_path, two_patches):
    repo, patches = two_patches
    for args, words in (
        (("--ref", "no-such-tag", "--repo", str(repo)), "not found"),
        (("--ref", "v1", "--repo", str(tmp_path / "nowhere")), "not found"),
    ):
        result = invoke("apply", *args, "--dest", str(tmp_path / "d"), "--patches", str(patches))
        assert result.exit_code != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("megaport: error:") and words in lines[0]
        assert not (tmp_path / "d").exists()


HOSTILE = {
    "dotdot": "diff --git a/../evil.py b/../evil.py\nnew file mode 100644\n--- /dev/null\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+x\n",
    "absolute": "diff --git a/tmp/evil b/tmp/evil\nnew file mode 100644\n--- /dev/null\n+++ /tmp/evil\n@@ -0,0 +1 @@\n+x\n",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_paths_are_refused_before_any_write(tmp_path, kind):
    repo = upstream(tmp_path)
    patches = catalogue(tmp_path, {"0001-evil.patch": "Subject: [PATCH] evil\n\n---\n" + HOSTILE[kind]})
    dest = tmp_path / "ported"
    before = snapshot(tmp_path)
    result = invoke("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert result.exit_code != 0
    assert "unsafe path" in result.stderr or "refusing" in result.stderr
    assert snapshot(tmp_path) == before and not (tmp_path.parent / "evil.py").exists()


def test_symlink_escape_is_refused_before_any_write(tmp_path):
    repo = upstream(tmp_path)
    os.symlink("/tmp", repo / "megatron/outside")
    commit(repo, {}, "add a link", tag="v2")
    patch = ("Subject: [PATCH] escape\n\n---\n"
             "diff --git a/megatron/outside/evil.py b/megatron/outside/evil.py\nnew file mode 100644\n"
             "--- /dev/null\n+++ b/megatron/outside/evil.py\n@@ -0,0 +1 @@\n+x\n")
    patches = catalogue(tmp_path, {"0001-escape.patch": patch})
    dest = tmp_path / "ported"
    result = invoke("apply", "--ref", "v2", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert result.exit_code != 0 and "symbolic link" in result.stderr
    assert not dest.exists() and not Path("/tmp/evil.py").exists()


def test_a_patched_script_keeps_its_executable_bit(tmp_path):
    repo = upstream(tmp_path, {**BASE, "tools/run.sh": "#!/bin/sh\necho upstream\n"})
    os.chmod(repo / "tools/run.sh", 0o755)
    commit(repo, {}, "make run.sh executable")
    git(repo, "tag", "-f", "v1")
    patch = diff_for(repo, {"tools/run.sh": "#!/bin/sh\necho rocm\n"}, "script")
    patches = catalogue(tmp_path, {"0001-script.patch": patch})
    dest = tmp_path / "ported"
    result = invoke("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(dest), "--patches", str(patches))
    assert result.exit_code == 0, result.output
    assert (dest / "tools/run.sh").read_text() == "#!/bin/sh\necho rocm\n"
    assert os.access(dest / "tools/run.sh", os.X_OK)
    assert git(dest, "ls-tree", "HEAD", "tools/run.sh").split()[0] == "100755"


def test_builtin_series_are_listed_with_their_tested_refs():
    result = invoke("series", "--json", "-")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    names = {s["name"]: s for s in document["series"]}
    assert {"core-0.13-0.16", "core-0.18-main"} <= set(names)
    assert "core_v0.16.1" in {t["ref"] for t in names["core-0.13-0.16"]["tested"]}


def test_builtin_series_say_which_lines_they_are_tested_on():
    """Users port main's first-parent commits, release-branch heads, dev, dated alpha branches
    and feature branches (issue 40): `megaport series` says which of them each series is tested on."""
    from megaport.catalogue import LINES

    result = invoke("series", "--json", "-")
    assert result.exit_code == 0
    names = {s["name"]: s for s in json.loads(result.stdout)["series"]}
    assert all(t["line"] in LINES for s in names.values() for t in s["tested"])
    assert names["core-0.18-main"]["lines"] == ["main", "release"]
    assert "dev" in names["core-0.19-dev"]["lines"]
    assert {"release", "alpha", "feature"} <= set(names["core-0.17"]["lines"])
    assert {t["ref"]: t["line"] for t in names["core-0.17"]["tested"]}["26.04-alpha"] == "alpha"
    lines_on = {line for s in names.values() for line in s["lines"]}
    assert lines_on == set(LINES)
    table = invoke("series")
    assert "lines" in table.output and "main, release" in table.output


ONE_PATCH = {"0001-change.patch": "Subject: [PATCH] change\n"}


def test_a_tested_ref_s_line_comes_from_its_name_unless_the_entry_names_it(tmp_path):
    tested = ", ".join([
        '{ ref = "main", sha = "" }', '{ ref = "core_r0.19.0", sha = "" }', '{ ref = "core_v0.18.0", sha = "" }',
        '{ ref = "dev", sha = "" }', '{ ref = "26.04-alpha", sha = "" }', '{ ref = "dsv4", sha = "" }',
        '{ ref = "v2.0", sha = "", line = "main" }',
    ])
    root = write_catalogue(tmp_path / "cat", ONE_PATCH, entry=DEMO_ENTRY + f"tested = [{tested}]\n")
    result = invoke("series", "--patches", str(root), "--json", "-")
    assert result.exit_code == 0, result.output
    (demo,) = json.loads(result.stdout)["series"]
    assert [t["line"] for t in demo["tested"]] == ["main", "release", "release", "dev", "alpha", "feature", "main"]
    assert demo["lines"] == ["main", "release", "dev", "alpha", "feature"]
    wrong = write_catalogue(tmp_path / "wrong", ONE_PATCH, entry=DEMO_ENTRY + 'tested = [{ ref = "v1", line = "nightly" }]\n')
    result = invoke("series", "--patches", str(wrong))
    assert result.exit_code == 2
    assert "line 'nightly' is not one of main, release, dev, alpha, feature" in result.output


def test_builtin_series_carry_the_replacement_source_exactly():
    """Editing the replacement source without `megaport regenerate` must fail here."""
    result = invoke("regenerate", "--check")
    assert result.exit_code == 0, result.output


def test_git_am_applies_a_builtin_series_without_megaport(tmp_path):
    """The series files are plain format-patch output: git itself can parse every one."""
    from megaport.catalogue import load_catalogue

    for series in load_catalogue().series:
        for patch in series.patches:
            out = subprocess.run(["git", "mailinfo", "/dev/null", "/dev/null"], input=patch.path.read_bytes(),
                                 capture_output=True, cwd=tmp_path)
            assert out.returncode == 0 and b"Subject: " in out.stdout, patch.name


def test_fallback_prefers_the_series_that_lands_more_patches_over_fewer_offsets():
    """Main's 0.13.0rc0 commits of 2025-04: core-0.10-0.12 (the series of core 0.10 and 0.11 until
    they were split by their converter's shapes) and core-0.12 both landed, core-0.12 with its
    converter patches too but more offsets; the fewer offsets won and the tree lost those patches."""
    from types import SimpleNamespace

    from megaport.selection import _fit_cost

    def plan(name, statuses, offsets, fuzz=0):
        return SimpleNamespace(name=name, patches=[SimpleNamespace(status=s) for s in statuses],
                               hunk_counts={"offset": offsets, "fuzz": fuzz})

    fewer = plan("core-0.10-0.12", ["applied"] * 7, offsets=3)
    more = plan("core-0.12", ["applied"] * 10, offsets=9)
    assert min([fewer, more], key=_fit_cost).name == "core-0.12"
    assert min([fewer, plan("fuzzy", ["applied"] * 10, offsets=0, fuzz=1)], key=_fit_cost).name == "core-0.10-0.12"
    assert min([fewer, plan("skips", ["applied"] * 9 + ["skipped"], offsets=0)], key=_fit_cost).name == "core-0.10-0.12"


def test_fallback_never_half_ports_a_full_tree(tmp_path):
    """A series that fits only by skipping patches is from another era, unless the tree is core-only."""
    files = dict(BASE, **{"megatron/training/arguments.py": "x = 1\n"})
    repo = upstream(tmp_path, files)
    core = diff_for(repo, {"megatron/core/b.py": "alpha\nBETA\ngamma\ndelta\n"}, "core change")
    legacy = ("Subject: [PATCH] legacy\n\n---\ndiff --git a/megatron/legacy/x.py b/megatron/legacy/x.py\n"
              "--- a/megatron/legacy/x.py\n+++ b/megatron/legacy/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    patches = catalogue(tmp_path, {"0001-core.patch": core, "0002-legacy.patch": legacy},
                        recognise='core_version = { min = "9.0.0" }\n')
    (patches / "catalogue.toml").write_text((patches / "catalogue.toml").read_text().replace(
        'era = "test"', 'era = "test"\noptional = ["megatron/legacy"]'))
    result = invoke("apply", "--ref", "v1", "--repo", str(repo), "--dest", str(tmp_path / "d"), "--patches",
                    str(patches), "--dry-run")
    assert result.exit_code == 1
    assert "applies only by skipping 0002-legacy.patch" in result.stderr

    core_only = {k: v for k, v in BASE.items()}
    repo2 = tmp_path / "core-only"
    make_repo(repo2, core_only, tag="v1")
    result = invoke("apply", "--ref", "v1", "--repo", str(repo2), "--dest", str(tmp_path / "d2"), "--patches",
                    str(patches), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "matches no series range; a dry run fits demo best" in result.output
