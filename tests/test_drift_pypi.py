"""`megaport drift` on real upstream code: the PyPI-built megatron/core repository (core_v0.13.0 …
core_v0.16.1), the same check CI runs. Drift that still applies (offsets) is allowed; a conflict
or a missing file is not."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from megaport.catalogue import load_catalogue
from megaport.cli import main

pytestmark = pytest.mark.upstream

CI_TAGS = "core_v0.1[3-6]*"
E6 = ["0.13.0", "0.13.1", "0.14.0", "0.15.0", "0.15.1", "0.15.2", "0.15.3", "0.16.0", "0.16.1"]


def drift(*args: str):
    result = CliRunner().invoke(main, ["drift", *args])
    assert result.exit_code != 3, result.output
    return result.exit_code, json.loads(result.stdout)


def test_ci_testable_series_have_no_conflicts(core_upstream):
    code, report = drift("--repo", str(core_upstream), "--ref", CI_TAGS, "--series", "auto", "--format", "json")
    assert code < 2, report
    assert [r["ref"] for r in report["refs"]] == [f"core_v{v}" for v in E6]
    assert {r["series"] for r in report["refs"]} == {"core-0.13-0.16"}
    hunks = [h for r in report["refs"] for p in r["patches"] for h in p["hunks"]]
    assert hunks and not [h for h in hunks if h["status"] in ("conflict", "missing")]
    # The shipped series are tested "with no fuzz": drift may only be offsets here.
    assert {h["status"] for h in hunks} <= {"clean", "offset"}


def test_every_series_against_every_tag_in_one_command(core_upstream):
    code, report = drift("--repo", str(core_upstream), "--ref", "core_v*", "--series", "all", "--format", "json")
    names = [s.name for s in load_catalogue().series]
    tags = sorted({r["ref"] for r in report["refs"]})
    assert len(report["refs"]) == len(tags) * len(names)
    assert {(r["ref"], r["series"]) for r in report["refs"]} == {(t, n) for t in tags for n in names}
    assert code == report["exit_code"] and code in (1, 2)
    e6 = [r for r in report["refs"] if r["series"] == "core-0.13-0.16" and r["ref"] in {f"core_v{v}" for v in E6}]
    assert len(e6) == len(E6) and all(r["status"] in ("clean", "offset") for r in e6)
