"""`megaport drift` and `megaport apply` give one verdict on every ref (issue 40).

Both ask megaport.selection.decide; these tests build the refs where a drift check that ranked its
own hunk words used to call a tree fine that apply refuses, and check, ref by ref and at two
fuzz levels, that drift exits at most 1 exactly where apply ports, with apply's series, and
that where apply refuses drift exits 2 with apply's own one-line reason.

Upstream (megatron/core 0.14.0, a full tree: core, training and legacy) and two series:

    new  recognised (core 0.13 … 0.17): a.py line 20 (core), t.py (training)
    old  never recognised (core ≥ 9): a.py line 32 (core), l.py (legacy): the fallback

    ref            upstream changed                          apply (--fuzz 0)
    v1             nothing                                   ports with new
    offset         5 lines above a.py's hunk                 ports with new
    fuzz           the first context line of new's hunk,     refuses; --fuzz 1 ports with new
                   and the line old changes
    conflict       the line new changes                      falls back: old ports
    skip           new conflicts, legacy deleted             refuses: old lands only by skipping l.py
    core-only      new conflicts, only megatron/core left    ports with old (PyPI's megatron-core)
    merge          a context line between new's two changes, refuses (apply has no three-way merge)
                   and the line old changes
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.agreement import agreements
from support.gitrepos import commit, git, make_repo

from megaport.cli import main

A = "".join(f"value_{i} = {i}\n" for i in range(1, 41))
T = "".join(f"train_{i} = {i}\n" for i in range(1, 21))
L = "".join(f"legacy_{i} = {i}\n" for i in range(1, 21))

BASE = {
    "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 14\nPATCH = 0\n",
    "megatron/core/a.py": A,
    "megatron/training/t.py": T,
    "megatron/legacy/l.py": L,
}

SERIES = {
    # new: one hunk changing lines 20 and 24 (21-23 are context between the two changes)
    "new": {
        "0001-core.patch": ("megatron/core/a.py", A.replace("value_20 = 20\n", "value_20 = 2000\n")
                            .replace("value_24 = 24\n", "value_24 = 2400\n")),
        "0002-training.patch": ("megatron/training/t.py", T.replace("train_5 = 5\n", "train_5 = 50\n")),
    },
    "old": {
        "0001-core.patch": ("megatron/core/a.py", A.replace("value_32 = 32\n", "value_32 = 3200\n")),
        "0002-legacy.patch": ("megatron/legacy/l.py", L.replace("legacy_5 = 5\n", "legacy_5 = 50\n")),
    },
}

RECOGNISE = {"new": 'core_version = { min = "0.13.0", max = "0.17.0" }', "old": 'core_version = { min = "9.0.0" }'}

CONFLICT = {"megatron/core/a.py": A.replace("value_20 = 20\n", "value_20 = compute(20)\n")}
OLD_GONE = A.replace("value_32 = 32\n", "value_32 = compute(32)\n")  # old cannot be the fallback
SCENARIOS = {
    "offset": (
        {"megatron/core/a.py": "".join(f"# header {i}\n" for i in range(5)) + A}, ()),
    "fuzz": ({"megatron/core/a.py": OLD_GONE.replace("value_17 = 17\n", "value_17 = 17  # edited\n")}, ()),
    "conflict": (CONFLICT, ()),
    "skip": (CONFLICT, ("megatron/legacy/l.py",)),
    "core-only": (CONFLICT, ("megatron/legacy/l.py", "megatron/training/t.py")),
    "merge": ({"megatron/core/a.py": OLD_GONE.replace("value_22 = 22\n", "value_22 = twenty_two\n")}, ()),
}
REFS = ("v1", *SCENARIOS)


def format_patch(repo: Path, path: str, content: str, subject: str) -> str:
    """A real `git format-patch` of one file change on top of HEAD (then undone)."""
    head = git(repo, "rev-parse", "HEAD")
    commit(repo, {path: content}, f"{subject}\n\nWhy: the test says so.\n\nUpstream-Range: v1..v1")
    text = git(repo, "format-patch", "--stdout", "--zero-commit", "--full-index", "--no-signature", "-1", "HEAD")
    git(repo, "reset", "--quiet", "--hard", head)
    return text + "\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, Path]:
    """The upstream repository with every scenario tagged, and the two-series catalogue."""
    base = tmp_path_factory.mktemp("agree")
    repo = base / "upstream"
    v1 = make_repo(repo, BASE, tag="v1")
    catalogue = base / "catalogue"
    entries = ["format = 1\n"]
    for name, patches in SERIES.items():
        (catalogue / name).mkdir(parents=True)
        for filename, (path, content) in patches.items():
            (catalogue / name / filename).write_text(format_patch(repo, path, content, f"{name}: change {path}"))
        (catalogue / name / "series").write_text("".join(f"{f}\n" for f in patches))
        entries.append(
            f'[[series]]\nname = "{name}"\nera = "test"\nsummary = "{name}"\n'
            f'optional = ["megatron/training", "megatron/legacy"]\ntested = [{{ ref = "v1", sha = "{v1}" }}]\n'
            f"[series.recognise]\n{RECOGNISE[name]}\n"
        )
    (catalogue / "catalogue.toml").write_text("\n".join(entries))
    for tag, (files, deleted) in SCENARIOS.items():
        git(repo, "checkout", "--quiet", "-b", f"branch-{tag}", "v1")
        commit(repo, files, f"upstream: {tag}", tag=tag, delete=deleted)
    return repo, catalogue


def apply_verdict(world, tmp_path, ref: str, fuzz: int, series: str | None = None) -> dict:
    """apply --dry-run's JSON report (exit code added)."""
    repo, catalogue = world
    report = tmp_path / f"apply-{ref}-{fuzz}-{series}.json"
    args = ["apply", "--repo", str(repo), "--patches", str(catalogue), "--ref", ref, "--dest", str(tmp_path / "d"),
            "--dry-run", "--fuzz", str(fuzz), "--json", str(report)] + (["--series", series] if series else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    return {**json.loads(report.read_text()), "exit_code": result.exit_code}


def drift_verdict(world, ref: str, fuzz: int, series: str = "auto") -> tuple[int, dict]:
    repo, catalogue = world
    result = CliRunner().invoke(main, ["drift", "--repo", str(repo), "--patches", str(catalogue), "--ref", ref,
                                       "--apply-fuzz", str(fuzz), "--series", series, "--format", "json"])
    assert result.exit_code in (0, 1, 2), result.output
    (entry,) = json.loads(result.stdout)["refs"]
    return result.exit_code, entry


@pytest.mark.parametrize("fuzz", [0, 1])
@pytest.mark.parametrize("ref", REFS)
def test_drift_exits_at_most_1_exactly_where_apply_ports(world, tmp_path, ref, fuzz):
    applied = apply_verdict(world, tmp_path, ref, fuzz)
    code, entry = drift_verdict(world, ref, fuzz)
    assert (applied["exit_code"] == 0) == (code <= 1), (applied, entry)
    if applied["exit_code"] == 0:
        assert entry["series"] == applied["series"] and entry["refusal"] is None
        assert entry["reason"] == applied["reason"]
    else:
        assert entry["status"] in ("conflict", "missing") and entry["refusal"] == applied["error"]


@pytest.mark.parametrize("series", ["new", "old"])
@pytest.mark.parametrize("ref", REFS)
def test_a_named_series_is_refused_by_drift_where_apply_refuses_it(world, tmp_path, ref, series):
    applied = apply_verdict(world, tmp_path, ref, 0, series)
    code, entry = drift_verdict(world, ref, 0, series)
    assert (applied["exit_code"] == 0) == (code <= 1), (applied, entry)
    if applied["exit_code"]:
        # apply adds what it did not do ("nothing was written") to the same reason
        assert applied["error"].startswith(entry["refusal"] + "; nothing was written")


def test_the_refs_hold_the_cases_where_drift_and_apply_could_disagree(world, tmp_path):
    """Each scenario is what the docstring says, so the agreement above is not vacuous."""
    ported = {ref: apply_verdict(world, tmp_path, ref, 0) for ref in REFS}
    assert {ref: v["series"] for ref, v in ported.items() if v["exit_code"] == 0} == {
        "v1": "new", "offset": "new", "conflict": "old", "core-only": "old",
    }
    # A fallback whose patches are skipped on a full tree: every hunk that is checked lands.
    code, skip = drift_verdict(world, "skip", 0)
    assert code == 2 and skip["series"] == "old" and {p["status"] for p in skip["patches"]} == {"clean", "skipped"}
    assert "it applies only by skipping 0002-legacy.patch" in skip["refusal"]
    # Hunks that land with fuzz or a merge at drift's own --fuzz 2; apply at --fuzz 0 refuses both.
    assert drift_verdict(world, "fuzz", 0)[1]["patches"][0]["status"] == "fuzz"
    assert drift_verdict(world, "merge", 0)[1]["patches"][0]["status"] == "3way"


def test_tools_drift_agreement_compares_the_same_way(world, tmp_path):
    """tools/drift-agreement's comparison (support.agreement) finds every ref agreeing here, apply
    refusing the three refs it refuses above, and sees a disagreement as one."""
    repo, catalogue = world
    found = agreements(repo, [(ref, git(repo, "rev-parse", ref)) for ref in REFS], tmp_path, patches=catalogue)
    assert [(a.ref, a.problem) for a in found] == [(ref, "") for ref in REFS]
    assert {a.ref for a in found if not a.ports} == {"fuzz", "skip", "merge"}
    ported = next(a for a in found if a.ref == "offset")
    assert replace(ported, drift_exit=2).problem == "apply exit 0, drift exit 2 (no refusal)"
    assert replace(ported, drift_series="old").problem == "apply chose new, drift old"


def test_a_refusal_names_the_fuzz_that_would_port_the_tree(world, tmp_path):
    refused = apply_verdict(world, tmp_path, "fuzz", 0)
    assert refused["exit_code"] == 1
    assert "; --fuzz 1 would port it with new, placing 1 hunk where up to 1 of their context lines" in refused["error"]
    assert "megatron/core/a.py hunk #1 at line 17" in refused["error"]
    assert apply_verdict(world, tmp_path, "fuzz", 1)["series"] == "new"
    # No fuzz ports a three-way-only tree: the error does not promise one.
    assert "--fuzz" not in apply_verdict(world, tmp_path, "merge", 0)["error"].split("refresh a series for this ref")[1]
