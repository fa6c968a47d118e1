"""tools/verify-eras runs the sampled commits' every-family pass (verify --layouts none), and the
newest tested refs' whole verify, unless told otherwise. No clone needed: targets are stood in."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "verify-eras"


ABC = "s@abc (before f00, gpt: a fix)"


@pytest.fixture()
def tool(monkeypatch):
    loader = importlib.machinery.SourceFileLoader("verify_eras", str(TOOL))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("verify_eras", loader))
    loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module, "targets", lambda *a, **k: [("s@oldest", "R", "a1"), (ABC, "R", "b2")])
    monkeypatch.setattr(module, "verify_one", lambda label, repo, ref, python, folder, model=None, layouts=None:
                        calls.append((label, layouts)) or {"label": label, "ref": ref, "error": "stood in"})
    return module, calls


@pytest.mark.parametrize("argv, expected", [
    (["--sampled"], [("s@oldest", "none"), (ABC, "none")]),
    (["--sampled", "--layouts", "tp2"], [("s@oldest", "tp2"), (ABC, "tp2")]),
    ([], [("s@oldest", None), (ABC, None)]),
    (["--sampled", "--only", "*@oldest"], [("s@oldest", "none")]),
    (["--sampled", "--only", "s@abc"], [(ABC, "none")]),  # the commit's label without why it was sampled
])
def test_what_each_ref_verifies(tool, tmp_path, argv, expected):
    module, calls = tool
    assert module.main(["--repo", "R", "--keep", str(tmp_path), *argv]) == 1  # the stand-in results are errors
    assert calls == expected


def test_a_glob_that_matches_nothing_is_an_error_not_an_empty_green_run(tool, tmp_path, capsys):
    module, calls = tool
    assert module.main(["--repo", "R", "--keep", str(tmp_path), "--sampled", "--only", "s@f00"]) == 2
    assert calls == []
    assert "no ref's label matches --only 's@f00'" in capsys.readouterr().err


def test_a_fix_that_changes_only_a_familys_readme_is_not_sampled(tmp_path):
    import git

    loader = importlib.machinery.SourceFileLoader("verify_eras_fixes", str(TOOL))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("verify_eras_fixes", loader))
    loader.exec_module(module)
    repo = git.Repo.init(tmp_path)
    moe = tmp_path / "megatron" / "core" / "transformer" / "moe"
    moe.mkdir(parents=True)
    shas = []
    for name, text in (("router.py", "x = 1\n"), ("README.md", "docs\n"), ("router.py", "x = 2\n")):
        (moe / name).write_text(text)
        repo.index.add([str(moe / name)])
        shas.append(repo.index.commit(f"fix {name}").hexsha)
    paths = module.FAMILY_PATHS["moe"]
    assert [module.fixes_code(repo.git, sha, paths) for sha in shas[1:]] == [False, True]
