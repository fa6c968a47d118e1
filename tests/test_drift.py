"""`megaport drift` on small drifted upstream histories built with support.gitrepos.

One upstream (tag v1) and five one-file patches made on it with git format-patch. Each scenario
is a branch off v1 that drifts one way, tagged ``s_<what>``:

    s_clean     an unrelated new file               every hunk clean          exit 0
    s_offset    5 lines inserted above a hunk        offset +5                 exit 1
    s_fuzz      the hunk's first context line edited fuzz 1                    exit 2 (apply refuses)
    s_3way      a context line between two changes   3way (fuzz cannot help)   exit 2 (apply refuses)
    s_applied   one hunk's change made upstream      applied                   exit 2 (apply refuses)
    s_conflict  the line a hunk changes, rewritten   conflict (+ nearest line) exit 2
    s_renamed   a patched file moved                 missing + likely new path exit 2
    s_deleted   a patched file deleted               missing                   exit 2

Every result also carries apply's verdict (megaport.selection.decide): a series that lands only
with fuzz, a merge or a half-applied patch is one ``megaport apply`` refuses, so drift exits 2.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.catalogues import write_catalogue
from support.gitrepos import commit, git, make_repo

from megaport.cli import main

A = "".join(f"value_{i} = {i}\n" for i in range(1, 41))
B = "".join(f"beta_{i} = '{i}'\n" for i in range(1, 31))
C = "".join(f"gamma_{i} = [{i}]\n" for i in range(1, 41))
D = "".join(f"delta_{i} = {i}.0\n" for i in range(1, 11))
E = "".join(f"def epsilon_{i}():\n    return {i}\n" for i in range(1, 11))

BASE = {
    "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 14\nPATCH = 0\n",
    "megatron/core/a.py": A,
    "megatron/core/b.py": B,
    "megatron/core/c.py": C,
    "megatron/core/d.py": D,
    "megatron/core/e.py": E,
}

PATCHES = {
    # one hunk: line 20 changes (context 17-19 and 21-23)
    "0001-a.patch": ("megatron/core/a.py", A.replace("value_20 = 20\n", "value_20 = 2000\n"), "Change a"),
    # one hunk with two changes three lines apart (lines 10 and 14; 11-13 are context between)
    "0002-b.patch": ("megatron/core/b.py", B.replace("beta_10 = '10'\n", "beta_10 = 'ten'\n")
                     .replace("beta_14 = '14'\n", "beta_14 = 'fourteen'\n"), "Change b"),
    # two hunks far apart (lines 5 and 35)
    "0003-c.patch": ("megatron/core/c.py", C.replace("gamma_5 = [5]\n", "gamma_5 = [5, 5]\n")
                     .replace("gamma_35 = [35]\n", "gamma_35 = [35, 35]\n"), "Change c"),
    "0004-d.patch": ("megatron/core/d.py", D.replace("delta_3 = 3.0\n", "delta_3 = 3.5\n"), "Change d"),
    "0005-e.patch": ("megatron/core/e.py", E.replace("    return 3\n", "    return 33\n"), "Change e"),
}

SCENARIOS = {
    "s_clean": ({"megatron/core/f.py": "new = 1\n"}, ()),
    "s_offset": ({"megatron/core/a.py": "".join(f"# header {i}\n" for i in range(5)) + A}, ()),
    "s_fuzz": ({"megatron/core/a.py": A.replace("value_17 = 17\n", "value_17 = 17  # edited\n")}, ()),
    "s_3way": ({"megatron/core/b.py": B.replace("beta_12 = '12'\n", "beta_12 = 'twelve'\n")}, ()),
    "s_applied": ({"megatron/core/c.py": C.replace("gamma_5 = [5]\n", "gamma_5 = [5, 5]\n")}, ()),
    "s_conflict": ({"megatron/core/a.py": A.replace("value_20 = 20\n", "value_20 = compute(20)\n")}, ()),
    "s_renamed": ({"megatron/core/moved/e.py": E}, ("megatron/core/e.py",)),
    "s_deleted": ({}, ("megatron/core/d.py",)),
}


def format_patch(repo: Path, path: str, content: str, subject: str) -> str:
    """A real `git format-patch` of one file change on top of HEAD (then undone)."""
    head = git(repo, "rev-parse", "HEAD")
    commit(repo, {path: content}, f"{subject}\n\nWhy: the test says so.\n\nUpstream-Range: v1..v1")
    text = git(repo, "format-patch", "--stdout", "--zero-commit", "--full-index", "--no-signature", "-1", "HEAD")
    git(repo, "reset", "--quiet", "--hard", head)
    return text + "\n"


def demo_catalogue(root: Path, patches: dict[str, str], *, name: str = "demo", tested: str = "") -> Path:
    entry = f'era = "test"\nsummary = "demo series"\noptional = ["megatron/training"]\ntested = [{tested}]\n'
    recognise = 'core_version = { min = "0.13.0", max = "0.17.0" }\n'
    return write_catalogue(root, patches, name=name, entry=entry, recognise=recognise)


def build_upstream(base: Path) -> tuple[Path, dict[str, str], str]:
    """The upstream repo with every scenario tagged, and the patch texts (made on v1)."""
    repo = base / "upstream"
    v1 = make_repo(repo, BASE, tag="v1")
    patches = {name: format_patch(repo, *spec) for name, spec in PATCHES.items()}
    for tag, (files, deleted) in SCENARIOS.items():
        git(repo, "checkout", "--quiet", "-b", f"branch-{tag}", "v1")
        commit(repo, files, f"upstream: {tag}", tag=tag, delete=deleted)
    git(repo, "checkout", "--quiet", "main")
    # main moves on: three more commits, the last one drifting a.py by two lines.
    commit(repo, {"megatron/core/f.py": "one = 1\n"}, "main 1")
    commit(repo, {"megatron/core/f.py": "one = 1\ntwo = 2\n"}, "main 2")
    commit(repo, {"megatron/core/a.py": "# x\n# y\n" + A}, "main 3")
    return repo, patches, v1


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    return build_upstream(tmp_path_factory.mktemp("drift"))


@pytest.fixture
def catalogue(tmp_path, upstream):
    repo, patches, v1 = upstream
    return demo_catalogue(tmp_path / "catalogue", patches, tested=f'{{ ref = "v1", sha = "{v1}" }}')


def drift(*args: str):
    return CliRunner().invoke(main, ["drift", *args])


def drift_json(repo: Path, catalogue: Path, *refs: str, extra=()) -> tuple[int, dict]:
    args = [a for ref in refs for a in ("--ref", ref)]
    result = drift("--repo", str(repo), "--patches", str(catalogue), "--format", "json", *args, *extra)
    assert result.exit_code in (0, 1, 2), result.output
    return result.exit_code, json.loads(result.stdout)


def hunks_of(report: dict, ref: str) -> dict[str, list[dict]]:
    entry = next(r for r in report["refs"] if r["ref"] == ref)
    return {p["name"]: p["hunks"] for p in entry["patches"]}


def statuses(report: dict, ref: str) -> dict[str, str]:
    entry = next(r for r in report["refs"] if r["ref"] == ref)
    return {p["name"]: p["status"] for p in entry["patches"]}


# --- each kind of drift, with its exit code ------------------------------------------------


def test_clean_ref_exits_0(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_clean")
    assert code == 0
    assert report["refs"][0]["status"] == "clean"
    assert set(statuses(report, "s_clean").values()) == {"clean"}


def test_lines_inserted_above_a_hunk_are_an_offset(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_offset")
    assert code == 1
    (hunk,) = hunks_of(report, "s_offset")["0001-a.patch"]
    assert (hunk["status"], hunk["offset"], hunk["fuzz"], hunk["line"]) == ("offset", 5, 0, 22)
    assert statuses(report, "s_offset")["0002-b.patch"] == "clean"


def test_an_edited_outer_context_line_is_fuzz(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_fuzz")
    (hunk,) = hunks_of(report, "s_fuzz")["0001-a.patch"]
    assert (hunk["status"], hunk["fuzz"]) == ("fuzz", 1)
    # apply (--fuzz 0) refuses it, and says --fuzz 1 would port it: so does drift, with exit 2.
    entry = report["refs"][0]
    assert code == 2 and entry["status"] == "conflict"
    assert entry["refusal"].startswith("no series fits this tree") and "--fuzz 1 would port it with demo" in entry["refusal"]
    code, report = drift_json(upstream[0], catalogue, "s_fuzz", extra=("--apply-fuzz", "1"))
    assert code == 1 and report["refs"][0]["refusal"] is None and report["refs"][0]["status"] == "fuzz"


def test_fuzz_beyond_the_limit_is_not_fuzz(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_fuzz", extra=("--fuzz", "0"))
    (hunk,) = hunks_of(report, "s_fuzz")["0001-a.patch"]
    # Without fuzz the patch's preimage still merges: a three-way merge is the next resort.
    assert hunk["status"] == "3way" and code == 2


def test_a_context_line_between_two_changes_needs_a_three_way_merge(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_3way")
    assert code == 2 and "no series fits this tree" in report["refs"][0]["refusal"]  # apply has no merge
    (hunk,) = hunks_of(report, "s_3way")["0002-b.patch"]
    assert hunk["status"] == "3way"


def test_three_way_fetches_the_preimage_when_the_cache_lacks_it(upstream, tmp_path, monkeypatch):
    repo, patches, v1 = upstream
    monkeypatch.setenv("MEGAPORT_HOME", str(tmp_path / "fresh-cache"))  # nothing fetched yet
    # No tested sha in the catalogue: a shallow cache of s_3way alone has no v1 blob to merge with.
    bare = demo_catalogue(tmp_path / "bare", patches)
    code, report = drift_json(repo, bare, "s_3way")
    (hunk,) = hunks_of(report, "s_3way")["0002-b.patch"]
    assert code == 2 and hunk["status"] == "conflict"
    assert "preimage blob" in hunk["reason"]
    # With the tested sha known, drift fetches that commit (one sha) and merges.
    tested = demo_catalogue(tmp_path / "tested", patches, tested=f'{{ ref = "v1", sha = "{v1}" }}')
    code, report = drift_json(repo, tested, "s_3way")
    assert code == 2 and hunks_of(report, "s_3way")["0002-b.patch"][0]["status"] == "3way"


def test_a_hunk_already_upstream_is_applied(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_applied")
    assert code == 2  # half the patch is upstream's: apply refuses it
    first, second = hunks_of(report, "s_applied")["0003-c.patch"]
    assert first["status"] == "applied" and first["line"] == 2  # where the hunk (from its context) sits
    assert second["status"] == "clean"
    assert statuses(report, "s_applied")["0003-c.patch"] == "applied"


def test_a_whole_patch_already_upstream_is_applied(upstream, catalogue, tmp_path):
    repo = upstream[0]
    code, report = drift_json(repo, catalogue, "v1")
    assert code == 0
    clone = tmp_path / "ahead"
    git(tmp_path, "clone", "--quiet", str(repo), str(clone))
    commit(clone, {"megatron/core/d.py": PATCHES["0004-d.patch"][1]}, "upstream takes the d change", tag="took_d")
    code, report = drift_json(clone, catalogue, "took_d")
    assert code == 1
    (hunk,) = hunks_of(report, "took_d")["0004-d.patch"]
    assert hunk["status"] == "applied"


def test_a_rewritten_line_is_a_conflict_with_the_nearest_match(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_conflict")
    assert code == 2
    (hunk,) = hunks_of(report, "s_conflict")["0001-a.patch"]
    assert hunk["status"] == "conflict"
    assert hunk["nearest_line"] == 17 and 0.8 < hunk["similarity"] < 1
    assert report["refs"][0]["status"] == "conflict"


def test_a_renamed_file_is_missing_with_its_new_path(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_renamed")
    assert code == 2
    (hunk,) = hunks_of(report, "s_renamed")["0005-e.patch"]
    assert hunk["status"] == "missing"
    assert hunk["new_path"] == "megatron/core/moved/e.py"
    assert "git rename detection" in hunk["reason"]


def test_a_move_is_found_once_and_followed_on_every_later_ref(tmp_path, monkeypatch):
    """Over a long history, where a file went is asked of git's rename detection once, not once
    per ref (between commits years apart that diff is what made whole-history drift slow)."""
    import megaport.drift.renames as renames

    repo, patches, v1 = build_upstream(tmp_path)
    git(repo, "checkout", "--quiet", "-b", "long", "s_renamed")
    for n in range(6):
        commit(repo, {"megatron/core/f.py": f"n = {n}\n"}, f"later {n}")
    catalogue = demo_catalogue(tmp_path / "catalogue", patches, tested=f'{{ ref = "v1", sha = "{v1}" }}')
    diffs = []
    real_renamed_paths = renames.renamed_paths
    monkeypatch.setattr(renames, "renamed_paths", lambda *args: diffs.append(args) or real_renamed_paths(*args))

    code, report = drift_json(repo, catalogue, "long", extra=("--last", "7"))

    assert code == 2 and len(report["refs"]) == 7
    for entry in report["refs"]:
        (hunk,) = {p["name"]: p["hunks"] for p in entry["patches"]}["0005-e.patch"]
        assert hunk["status"] == "missing" and hunk["new_path"] == "megatron/core/moved/e.py"
        assert "git rename detection" in hunk["reason"]
    assert len(diffs) == 1


def test_a_renamed_file_is_found_by_name_without_a_commit_to_compare(upstream, tmp_path):
    repo, patches, _ = upstream
    untested = demo_catalogue(tmp_path / "untested", patches)
    code, report = drift_json(repo, untested, "s_renamed")
    (hunk,) = hunks_of(report, "s_renamed")["0005-e.patch"]
    assert code == 2 and hunk["status"] == "missing" and hunk["new_path"] == "megatron/core/moved/e.py"


def test_a_deleted_file_is_missing(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_deleted")
    assert code == 2
    (hunk,) = hunks_of(report, "s_deleted")["0004-d.patch"]
    assert hunk["status"] == "missing" and hunk["new_path"] is None
    assert hunk["reason"] == "file was deleted upstream"


def test_exit_code_is_the_worst_over_all_refs(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_clean", "s_offset")
    assert code == 1 and report["exit_code"] == 1 and report["status"] == "offset"
    code, report = drift_json(upstream[0], catalogue, "s_clean", "s_offset", "s_deleted")
    assert code == 2 and [r["status"] for r in report["refs"]] == ["clean", "offset", "missing"]


def test_one_run_over_many_refs_equals_one_run_per_ref(upstream, catalogue):
    """Results reused between refs (same file contents) and cached rename lookups change nothing."""
    refs = ["s_offset", "s_clean", "s_fuzz", "s_renamed", "s_3way", "s_conflict", "s_deleted", "s_applied"]
    _, together = drift_json(upstream[0], catalogue, *refs)
    alone = [drift_json(upstream[0], catalogue, ref)[1]["refs"][0] for ref in refs]
    assert together["refs"] == alone


# --- refs: globs, ranges, --last ------------------------------------------------------------


def test_a_glob_checks_every_matching_tag(upstream, catalogue):
    code, report = drift_json(upstream[0], catalogue, "s_*")
    assert code == 2
    assert sorted(r["ref"] for r in report["refs"]) == sorted(SCENARIOS)


def test_a_range_and_last_check_the_newest_commits(upstream, catalogue):
    repo = upstream[0]
    code, report = drift_json(repo, catalogue, "main~2..main")
    assert [r["ref"] for r in report["refs"]] == ["main~1", "main"]
    assert [r["status"] for r in report["refs"]] == ["clean", "offset"] and code == 1
    _, head = drift_json(repo, catalogue, "HEAD~1..HEAD")
    assert [(r["ref"], r["sha"]) for r in head["refs"]] == [("HEAD", git(repo, "rev-parse", "main"))]
    code, last = drift_json(repo, catalogue, "main", extra=("--last", "3"))
    assert [r["ref"] for r in last["refs"]] == ["main~2", "main~1", "main"]
    assert [r["sha"] for r in last["refs"]] == [git(repo, "rev-parse", f"main~{k}") for k in (2, 1, 0)]


def test_globs_sort_by_version_and_last_takes_the_newest_tags(upstream, catalogue, tmp_path):
    clone = tmp_path / "tags"
    git(tmp_path, "clone", "--quiet", str(upstream[0]), str(clone))
    for name in ("rel_1.10.0rc2", "rel_1.2.0", "rel_1.9.0", "rel_1.2.0rc1"):
        git(clone, "tag", name, "s_clean")
    git(clone, "tag", "-a", "-m", "an annotated tag names its commit", "rel_1.3.0", "s_offset")
    git(clone, "tag", "rel_1.4.0", "s_clean^{tree}")  # names no commit: not a ref to check
    _, report = drift_json(clone, catalogue, "rel_*")
    assert [r["ref"] for r in report["refs"]] == ["rel_1.2.0rc1", "rel_1.2.0", "rel_1.3.0", "rel_1.9.0", "rel_1.10.0rc2"]
    assert report["refs"][2]["sha"] == git(clone, "rev-parse", "s_offset^{commit}")
    _, newest = drift_json(clone, catalogue, "rel_*", "v1", extra=("--last", "1"))
    assert [r["ref"] for r in newest["refs"]] == ["rel_1.10.0rc2", "v1"]


def test_a_glob_matching_nothing_is_a_usage_error(upstream, catalogue):
    result = drift("--repo", str(upstream[0]), "--patches", str(catalogue), "--ref", "nope_*")
    assert result.exit_code == 3
    assert "no tags" in result.stderr and "match 'nope_*'" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--ref", "no-such-tag"),
        ("--ref", "v1", "--series", "no-such-series"),
        ("--ref", "v1", "--format", "yaml"),
        ("--ref", "v1", "--bogus"),
        (),
        ("--ref", "v1", "--patches", "/does/not/exist"),
    ],
)
def test_usage_and_environment_errors_exit_3(upstream, catalogue, args):
    base = ["--repo", str(upstream[0])]
    if "--patches" not in args:
        base += ["--patches", str(catalogue)]
    result = drift(*base, *args)
    assert result.exit_code == 3, result.output


def test_series_all_checks_every_series_and_auto_recognises(upstream, catalogue, tmp_path):
    repo, patches, _ = upstream
    root = demo_catalogue(tmp_path / "two", patches)
    # A second series whose recognise rule cannot match this tree.
    (root / "other").mkdir()
    (root / "other" / "0001-a.patch").write_text(patches["0001-a.patch"])
    (root / "other" / "series").write_text("0001-a.patch\n")
    with (root / "catalogue.toml").open("a") as handle:
        handle.write('\n[[series]]\nname = "other"\nera = "x"\n[series.recognise]\ncore_version = { min = "9.0.0" }\n')
    _, auto = drift_json(repo, root, "v1")
    assert [r["series"] for r in auto["refs"]] == ["demo"]
    assert "in its range" in auto["refs"][0]["reason"]
    _, every = drift_json(repo, root, "v1", extra=("--series", "all"))
    assert [r["series"] for r in every["refs"]] == ["demo", "other"]
    _, named = drift_json(repo, root, "v1", extra=("--series", "other"))
    assert [r["series"] for r in named["refs"]] == ["other"]


# --- report formats -------------------------------------------------------------------------


def test_json_shape_is_stable(upstream, catalogue):
    _, report = drift_json(upstream[0], catalogue, "s_offset")
    assert set(report) == {"format", "repo", "status", "exit_code", "refs"}
    entry = report["refs"][0]
    assert set(entry) == {"ref", "sha", "series", "reason", "refusal", "status", "counts", "patches"}
    assert entry["refusal"] is None
    assert entry["sha"] == git(upstream[0], "rev-parse", "s_offset")
    patch = entry["patches"][0]
    assert set(patch) == {"name", "subject", "status", "reason", "hunks"}
    assert set(patch["hunks"][0]) == {
        "file", "hunk", "header", "status", "offset", "fuzz", "line", "patch_line",
        "nearest_line", "similarity", "new_path", "reason",
    }
    assert entry["counts"] == {"clean": 5, "offset": 1}


def test_junit_has_a_suite_per_ref_and_a_failing_case_per_broken_patch(upstream, catalogue, tmp_path):
    out = tmp_path / "drift.xml"
    result = drift("--repo", str(upstream[0]), "--patches", str(catalogue), "--ref", "s_offset", "--ref", "s_deleted",
                   "--format", "junit", "--output", str(out))
    assert result.exit_code == 2
    root = ET.parse(out).getroot()
    assert root.tag == "testsuites" and root.get("tests") == "10" and root.get("failures") == "1"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["s_offset / demo", "s_deleted / demo"]
    assert [len(s.findall("testcase")) for s in suites] == [5, 5]
    (failure,) = root.iter("failure")
    assert failure.get("type") == "missing" and "megatron/core/d.py" in failure.get("message")
    offset_case = next(c for c in suites[0].findall("testcase") if c.get("name") == "0001-a.patch")
    assert offset_case.find("failure") is None and "offset +5" in offset_case.find("system-out").text


ANNOTATION = re.compile(r"^::(warning|error|notice) ([^:]*)::(.*)$")


def test_github_annotations_point_at_the_hunk_in_the_patch_file(upstream, catalogue, monkeypatch):
    monkeypatch.chdir(catalogue.parent)
    result = drift("--repo", str(upstream[0]), "--patches", str(catalogue), "--ref", "s_offset", "--ref", "s_conflict",
                   "--format", "github")
    assert result.exit_code == 2
    parsed = []
    for line in result.stdout.splitlines():
        match = ANNOTATION.match(line)
        assert match, line
        props = dict(p.split("=", 1) for p in match.group(2).split(","))
        parsed.append((match.group(1), props, match.group(3)))
    levels = [p[0] for p in parsed]
    assert levels == ["warning", "error", "notice"]
    for level, props, message in parsed[:2]:
        assert props["file"] == "catalogue/demo/0001-a.patch"
        patch_lines = (catalogue / "demo" / "0001-a.patch").read_text().splitlines()
        assert patch_lines[int(props["line"]) - 1].startswith("@@ -17,7 +17,7 @@")
    assert "offset +5" in parsed[0][2] and "nearest match at line 17" in parsed[1][2]


def test_markdown_is_a_table_and_summary_appends(upstream, catalogue, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n")
    result = drift("--repo", str(upstream[0]), "--patches", str(catalogue), "--ref", "s_clean", "--ref", "s_fuzz",
                   "--format", "markdown", "--summary", str(summary))
    assert result.exit_code == 2  # apply refuses s_fuzz at --fuzz 0
    rows = [line for line in result.stdout.splitlines() if line.startswith("| `s_")]
    assert len(rows) == 3  # two summary rows, one detail row
    assert "fuzz 1" in rows[-1]
    assert summary.read_text().startswith("# earlier step\n### megaport drift")
    assert summary.read_text().count("\n| `s_") == 3


def test_text_report_names_the_drift_and_the_refresh_command(upstream, catalogue):
    result = drift("--repo", str(upstream[0]), "--patches", str(catalogue), "--ref", "s_offset")
    assert result.exit_code == 1
    assert "megatron/core/a.py hunk #1 @@ -17,7 +17,7 @@: offset +5, lands at line 22" in result.stdout
    assert "megaport refresh --series demo --ref s_offset" in result.stdout
    assert "exit 1" in result.stdout
