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
    assert module.main(["--repo", "R", "--keep", str(tmp_path), "--ledger", str(tmp_path / "ledger.md"), *argv]) == 1  # the stand-in results are errors
    assert calls == expected


def test_a_glob_that_matches_nothing_is_an_error_not_an_empty_green_run(tool, tmp_path, capsys):
    module, calls = tool
    assert module.main(["--repo", "R", "--keep", str(tmp_path), "--ledger", str(tmp_path / "ledger.md"),
                        "--sampled", "--only", "s@f00"]) == 2
    assert calls == []
    assert "no ref's label matches --only 's@f00'" in capsys.readouterr().err


def _result(label, ref, failed=0):
    """verify_one's result for a sampled commit: GPT with parity, and one failed test if ``failed``."""
    parity = {"max_relative_difference": 8.0e-5, "grad_norm_max_relative_difference": 1.3e-3,
              "grad_norm_compared": True, "iterations": list(range(30)), "loss_drop": 0.3}
    return {"label": label, "ref": ref, "series": "s", "seconds": 1.0, "exit": int(bool(failed)),
            "summary": {"passed": 190, "failed": failed, "skipped": 0},
            "facts": {"loss_parity": parity, "families": {"gpt": {"loss_parity": parity}}},
            "failed": ["test_training[t5]"] if failed else [], "skipped": [],
            "why_failed": {"test_training[t5]": "AssertionError: loss parity"} if failed else {}}


def test_the_ledger_records_each_sampled_commit_and_pending_runs_the_rest(tool, monkeypatch, tmp_path):
    module, _ = tool
    ledger, runs = tmp_path / "sampled-commits.md", []
    ledger.write_text("# Sampled commits\n\nWhat the tool wrote.\n")
    outcome = {"a1": 0, "b2": 1}  # the oldest commit passes, the fix's parent fails a test
    monkeypatch.setattr(module, "verify_one", lambda label, repo, ref, *a, **k:
                        runs.append(ref) or _result(label, f"{ref}{'0' * 38}", outcome[ref]))
    argv = ["--repo", "R", "--keep", str(tmp_path), "--ledger", str(ledger), "--sampled"]
    assert module.main(argv) == 1
    text = ledger.read_text()
    assert text.startswith("# Sampled commits\n\nWhat the tool wrote.\n|")  # the prose above is kept
    rows = module.ledger_rows(ledger)
    assert rows["a10000000000"][1:] == ["s@oldest", rows["a10000000000"][2], "190 / 0 / 0", "gpt 8.0e-5 / 1.3e-3"]
    assert rows["b20000000000"][1] == "s@abc" and rows["b20000000000"][3] == "190 / 1 / 0"
    assert "failed: test_training[t5] (AssertionError: loss parity)" in rows["b20000000000"][4]
    assert [module.green(rows[c]) for c in ("a10000000000", "b20000000000")] == [True, False]

    runs.clear()  # --pending: only what the ledger does not have green; a rerun replaces its row
    monkeypatch.setattr(module, "targets", lambda *a, **k: [("s@oldest", "R", "a10000000000"), (ABC, "R", "b20000000000")])
    outcome.update({"a10000000000": 0, "b20000000000": 0})
    assert module.main([*argv, "--pending"]) == 0
    assert runs == ["b20000000000"]
    assert len(module.ledger_rows(ledger)) == 2 and all(map(module.green, module.ledger_rows(ledger).values()))
    assert module.main([*argv, "--pending"]) == 2  # nothing left: said, not an empty green run
    with pytest.raises(SystemExit):  # the ledger is of sampled commits: --pending alone is a usage error
        module.main(["--repo", "R", "--ledger", str(ledger), "--pending"])


def test_without_keep_no_ported_tree_is_left_behind(tool, monkeypatch, tmp_path):
    """A ported tree is 40-150 MB: a run over the sampled commits left every one in the temp dir."""
    module, _ = tool
    monkeypatch.setattr(module.tempfile, "tempdir", str(tmp_path))

    def ported(label, repo, ref, python, folder, *a, **k):
        (module.ported_at(folder, label) / "megatron").mkdir(parents=True)
        return _result(label, f"{ref}{'0' * 38}")
    monkeypatch.setattr(module, "verify_one", ported)
    assert module.main(["--repo", "R", "--ledger", str(tmp_path / "ledger.md"), "--sampled"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.md"]


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
