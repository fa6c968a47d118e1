"""tools/verify-eras runs the sampled commits' every-family pass (verify --layouts none), and the
newest tested refs' whole verify, unless told otherwise. No clone needed: targets are stood in."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "verify-eras"


@pytest.fixture()
def tool(monkeypatch):
    loader = importlib.machinery.SourceFileLoader("verify_eras", str(TOOL))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("verify_eras", loader))
    loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module, "targets", lambda *a, **k: [("s@oldest", "R", "a1"), ("s@abc", "R", "b2")])
    monkeypatch.setattr(module, "verify_one", lambda label, repo, ref, python, folder, model=None, layouts=None:
                        calls.append((label, layouts)) or {"label": label, "ref": ref, "error": "stood in"})
    return module, calls


@pytest.mark.parametrize("argv, expected", [
    (["--sampled"], [("s@oldest", "none"), ("s@abc", "none")]),
    (["--sampled", "--layouts", "tp2"], [("s@oldest", "tp2"), ("s@abc", "tp2")]),
    ([], [("s@oldest", None), ("s@abc", None)]),
    (["--sampled", "--only", "*@oldest"], [("s@oldest", "none")]),
])
def test_what_each_ref_verifies(tool, tmp_path, argv, expected):
    module, calls = tool
    assert module.main(["--repo", "R", "--keep", str(tmp_path), *argv]) == 1  # the stand-in results are errors
    assert calls == expected
