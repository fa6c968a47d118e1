"""Forks with their own series: a catalogue's [[fork]] marks and per-series ``repository``.

On small synthetic repositories (no clone needed): a tree holding a fork's mark is only ever
ported with that fork's series, by recognition and by the best-fit fallback alike, and an upstream
tree never gets a fork's series, even where both series would apply. ``megaport series`` and
``drift`` say which repository each series is for; a malformed ``repository`` is a one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.gitrepos import commit, git, make_repo
from test_cli_apply import diff_for as format_patch

from megaport.catalogue import UPSTREAM_REPOSITORY, load_catalogue
from megaport.cli import main

FORK = "acme/Megatron-Fork"
CODE = "".join(f"line {i}\n" for i in range(1, 21))
UPSTREAM_TREE = {"megatron/model/code.py": CODE, "pretrain_gpt.py": "import torch\n"}
FORK_TREE = {"megatron/model/code.py": CODE, "pretrain_gpt.py": "import torch\nimport deepspeed\n"}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def repos(tmp_path):
    """An upstream repository (tag up) and a fork of it (tag fork: adds `import deepspeed`)."""
    repo = tmp_path / "repo"
    make_repo(repo, UPSTREAM_TREE, tag="up")
    commit(repo, FORK_TREE, "the fork imports deepspeed", tag="fork")
    return repo


def write_catalogue(tmp_path: Path, repo: Path, *, fork_series=True, fork_fits=True) -> Path:
    """Series 'up' (upstream) and 'fork' (FORK): both change line 5, so each applies to either tree,
    unless ``fork_fits`` is False (then 'fork' expects a line neither tree has)."""
    root = tmp_path / "catalogue"
    entries = ['format = 1\n\n[[fork]]\nrepository = "%s"\n'
               'marks = [ { path = "pretrain_gpt.py", text = "\\nimport deepspeed\\n" } ]\n' % FORK]
    series = {"up": None, "fork": FORK} if fork_series else {"up": None}
    for name, repository in series.items():
        (root / name).mkdir(parents=True)
        old = "line 5\n" if (repository is None or fork_fits) else "line 5 of the fork\n"
        git(repo, "checkout", "--quiet", "up")
        if old != "line 5\n":
            commit(repo, {"megatron/model/code.py": CODE.replace("line 5\n", old)}, "scratch")
        patch = format_patch(repo, {"megatron/model/code.py": CODE.replace("line 5\n", f"{name} five\n")}, name)
        git(repo, "checkout", "--quiet", "fork")
        (root / name / "0001-change.patch").write_text(patch)
        (root / name / "series").write_text("0001-change.patch\n")
        entry = f'\n[[series]]\nname = "{name}"\nera = "test"\nsummary = "{name} series"\n'
        if repository:
            entry += f'repository = "{repository}"\n'
        entries.append(entry + "tested = []\n")
    (root / "catalogue.toml").write_text("".join(entries))
    return root


def dry_run(repo: Path, ref: str, catalogue: Path, tmp_path: Path):
    report = tmp_path / f"{ref}.json"
    result = invoke("apply", "--ref", ref, "--repo", str(repo), "--dest", str(tmp_path / "d"), "--patches",
                    str(catalogue), "--dry-run", "--json", str(report))
    return result, (json.loads(report.read_text()) if report.exists() else {})


def test_fork_tree_gets_the_fork_series_and_upstream_tree_the_upstream_one(tmp_path, repos):
    catalogue = write_catalogue(tmp_path, repos)
    result, report = dry_run(repos, "fork", catalogue, tmp_path)
    assert result.exit_code == 0, result.output
    assert report["series"] == "fork"
    assert f"{FORK} tree (pretrain_gpt.py has" in result.output
    result, report = dry_run(repos, "up", catalogue, tmp_path)
    assert result.exit_code == 0, result.output
    assert report["series"] == "up"


def test_fork_tree_is_never_half_ported_with_an_upstream_series(tmp_path, repos):
    # The fork's own series does not apply; upstream's would, but it is not the fork's.
    catalogue = write_catalogue(tmp_path, repos, fork_fits=False)
    result, report = dry_run(repos, "fork", catalogue, tmp_path)
    assert result.exit_code != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("megaport: error: no series fits this tree") and "nearest is fork" in message
    assert report.get("series") != "up"


def test_fork_tree_without_fork_series_is_a_one_line_error(tmp_path, repos):
    catalogue = write_catalogue(tmp_path, repos, fork_series=False)
    result, _ = dry_run(repos, "fork", catalogue, tmp_path)
    assert result.exit_code != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"megaport: error: no series in the catalogue is for {FORK} trees")


def test_drift_auto_keeps_each_tree_to_its_family(tmp_path, repos):
    catalogue = write_catalogue(tmp_path, repos)
    result = invoke("drift", "--repo", str(repos), "--patches", str(catalogue), "--ref", "up", "--ref", "fork",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    chosen = {r["ref"]: r["series"] for r in json.loads(result.stdout)["refs"]}
    assert chosen == {"up": "up", "fork": "fork"}


def test_series_lists_each_series_repository(tmp_path, repos):
    catalogue = write_catalogue(tmp_path, repos)
    out = tmp_path / "series.json"
    result = invoke("series", "--patches", str(catalogue), "--json", str(out))
    assert result.exit_code == 0, result.output
    assert FORK in result.output
    listed = {s["name"]: s["repository"] for s in json.loads(out.read_text())["series"]}
    assert listed == {"up": UPSTREAM_REPOSITORY, "fork": FORK}


@pytest.mark.parametrize("value", ['"Megatron-DeepSpeed"', '"a/b/c"', "3"])
def test_malformed_repository_is_a_one_line_error(tmp_path, repos, value):
    catalogue = write_catalogue(tmp_path, repos)
    text = (catalogue / "catalogue.toml").read_text().replace(f'repository = "{FORK}"\ntested', f"repository = {value}\ntested")
    (catalogue / "catalogue.toml").write_text(text)
    result = invoke("series", "--patches", str(catalogue))
    assert result.exit_code == 2
    assert "repository" in result.stderr and "must be a GitHub 'owner/name'" in result.stderr
    lint = invoke("lint", "--patches", str(catalogue))
    assert lint.exit_code != 0 and "must be a GitHub 'owner/name'" in lint.output


def test_builtin_catalogue_ships_the_deepspeed_fork_series():
    catalogue = load_catalogue()
    forks = {f.repository: f for f in catalogue.forks}
    assert "microsoft/Megatron-DeepSpeed" in forks
    fork_series = [s for s in catalogue.series if s.repository == "microsoft/Megatron-DeepSpeed"]
    assert {s.name for s in fork_series} >= {"mds-2021-07", "mds-2023-07", "mds-2023-07-07", "mds-2023-07-12",
                                             "mds-2023-08-11", "mds-2023-09", "mds-2024-05", "mds-2024-09",
                                             "mds-2024-12"}
    assert all(s.tested for s in fork_series)
    # The fork's 2023-07 merge, its HEAD and a 2022 commit are among the tested refs.
    shas = {t.sha[:8] for s in fork_series for t in s.tested}
    assert {"9e72d571", "f4157bea", "50b32515"} <= shas
    assert all(s.repository == UPSTREAM_REPOSITORY for s in catalogue.series if not s.name.startswith("mds-"))
