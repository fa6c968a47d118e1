"""`megaport lint`: one line per problem (where, what to do); exit 0 clean, 1 problems, 3 usage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.catalogues import copy_shipped, write_catalogue

from megaport.cli import main

PATCH = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: megaport <megaport@localhost>
Date: Sun, 22 Nov 2026 00:00:00 +0000
Subject: [PATCH] {subject}

{body}
diff --git a/{path} b/{path}
index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644
--- a/{path}
+++ b/{path}
@@ -1,3 +1,3 @@
 one
-two
+2
 three
"""

GOOD_BODY = "Upstream renamed nothing; we need 2.\n\nUpstream-Range: v1..v2\n"


def patch_text(subject="Change two", body=GOOD_BODY, path="megatron/core/a.py") -> str:
    return PATCH.format(subject=subject, body=body, path=path)


def make_catalogue(root: Path, patches: dict[str, str] | None = None, *, name="demo", extra_toml="") -> Path:
    patches = {"0001-change-two.patch": patch_text()} if patches is None else patches
    entry = f'era = "E1"\ntested = [{{ ref = "v1", sha = "{"a" * 40}" }}]\n{extra_toml}\n'
    recognise = 'core_version = { min = "0.1.0", max = "0.2.0" }\npresent = ["megatron"]\n'
    return write_catalogue(root, patches, name=name, entry=entry, recognise=recognise)


def lint(*args: str):
    return CliRunner().invoke(main, ["lint", *args])


def problems(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if not re.match(r"^\d+ problem\(s\) in ", line) and "no problems" not in line]


def test_a_good_catalogue_is_clean(tmp_path):
    root = make_catalogue(tmp_path / "cat")
    result = lint("--patches", str(root))
    assert result.exit_code == 0, result.output
    assert "no problems" in result.stdout


def test_the_shipped_series_are_clean(tmp_path):
    """Only the series catalogue.toml names (other people's series folders may be in progress)."""
    target = copy_shipped(tmp_path / "patches")
    result = lint("--patches", str(target))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "text, expected",
    [
        (patch_text(subject=""), "no subject"),
        (patch_text(body="Upstream-Range: v1..v2\n"), "no reason"),
        (patch_text(body="Because.\n"), "no 'Upstream-Range: <first>..<last>' trailer"),
        (patch_text(body="Because.\n\nUpstream-Range: v1\n"), "is not 'Upstream-Range: <first>..<last>'"),
        (patch_text(path="../outside.py"), "refusing unsafe path '../outside.py'"),
        (patch_text(path=".git/hooks/post-checkout"), "refusing unsafe path"),
        ("not a patch at all\n", "cannot be parsed"),
    ],
)
def test_patch_problems_are_one_line_each(tmp_path, text, expected):
    root = make_catalogue(tmp_path / "cat", {"0001-x.patch": text})
    result = lint("--patches", str(root))
    assert result.exit_code == 1
    (line,) = problems(result)
    assert line.startswith(f"{root}/demo/0001-x.patch") and expected in line


def test_missing_trailer_suggests_the_series_range(tmp_path):
    root = make_catalogue(tmp_path / "cat", {"0001-x.patch": patch_text(body="Because.\n")})
    (line,) = problems(lint("--patches", str(root)))
    assert "e.g. 'Upstream-Range: v1..v1'" in line and ":4:" in line  # the Subject line


def test_catalogue_and_folders_must_agree(tmp_path):
    root = make_catalogue(tmp_path / "cat")
    (root / "demo" / "0002-stray.patch").write_text(patch_text())
    (root / "orphan").mkdir()
    (root / "loose.patch").write_text(patch_text())
    with (root / "demo" / "series").open("a") as handle:
        handle.write("0003-gone.patch\n0001-change-two.patch\n")
    with (root / "catalogue.toml").open("a") as handle:
        handle.write('\n[[series]]\nname = "absent"\n')
    result = lint("--patches", str(root))
    assert result.exit_code == 1
    found = "\n".join(problems(result))
    assert "demo/0002-stray.patch: not in demo/series; list it or remove it" in found
    assert "demo/series:2: names 0003-gone.patch, which does not exist" in found
    assert "demo/series:3: '0001-change-two.patch' is listed twice" in found
    assert "orphan: folder is not in catalogue.toml" in found
    assert "loose.patch: patch outside any series folder" in found
    assert "series 'absent' has no folder absent/" in found
    assert len(problems(result)) == 6


@pytest.mark.parametrize(
    "recognise, expected",
    [
        ('core_version = { min = "zero" }', "core_version min 'zero' is not a version"),
        ('core_version = { min = "0.3.0", max = "0.2.0" }', "min must be below max"),
        ('present = "megatron"', "present must be a list of paths"),
        ('contains = [{ path = "a.py" }]', "contains must be a list of"),
        ('wat = 1', "unknown rule 'wat'"),
        ('absent = ["/etc/passwd"]', "absent path '/etc/passwd' is not a path inside the tree"),
    ],
)
def test_recognise_rules_must_parse(tmp_path, recognise, expected):
    root = make_catalogue(tmp_path / "cat")
    text = (root / "catalogue.toml").read_text()
    text = text.split("[series.recognise]")[0] + f"[series.recognise]\n{recognise}\n"
    (root / "catalogue.toml").write_text(text)
    result = lint("--patches", str(root))
    assert result.exit_code == 1
    (line,) = problems(result)
    assert line.startswith(f"{root}/catalogue.toml: series 'demo': recognise: ") and expected in line


def test_broken_toml_is_a_problem_not_a_crash(tmp_path):
    root = make_catalogue(tmp_path / "cat")
    (root / "catalogue.toml").write_text("[[series]\nname = \n")
    result = lint("--patches", str(root))
    assert result.exit_code == 1 and "not valid TOML" in result.stdout


def test_usage_errors_exit_3(tmp_path):
    assert lint("--patches", str(tmp_path / "nope")).exit_code == 3
    (tmp_path / "empty").mkdir()
    result = lint("--patches", str(tmp_path / "empty"))
    assert result.exit_code == 3 and "no catalogue.toml" in result.stderr
    assert lint("--bogus").exit_code == 3


def test_github_format_annotates_the_file_and_line(tmp_path, monkeypatch):
    root = make_catalogue(tmp_path / "cat", {"0001-x.patch": patch_text(body="Because.\n")})
    monkeypatch.chdir(tmp_path)
    result = lint("--patches", str(root), "--format", "github")
    assert result.exit_code == 1
    line = result.stdout.splitlines()[0]
    assert line.startswith("::error file=cat/demo/0001-x.patch,line=4,title=megaport lint::no 'Upstream-Range")


def test_the_wheel_lists_every_package_of_the_source():
    """A package missing from pyproject's list is missing from the wheel (the families were)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root / "src").parts) for p in (root / "src").rglob("__init__.py")}
    assert found - listed == set()
