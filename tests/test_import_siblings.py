"""The import smoke test imports a touched module of a script folder as that folder's script runs
it: upstream dev's tools/checkpoint/saver_core.py imports schema_core beside it, and without its
folder on sys.path the module was skipped as "needs schema_core, an upstream dependency"."""

from __future__ import annotations

import importlib
import sys

import pytest

from megaport.smoke import test_imports


def test_a_script_folder_module_finds_its_siblings(tmp_path, monkeypatch):
    folder = tmp_path / "tools" / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "schema_kept_apart.py").write_text("VALUE = 7\n")
    (folder / "saver_kept_apart.py").write_text("from schema_kept_apart import VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tools.checkpoint.saver_kept_apart")
    sys.modules.pop("tools.checkpoint.saver_kept_apart", None)
    module = test_imports._import_beside_its_siblings("tools.checkpoint.saver_kept_apart",
                                                      folder / "saver_kept_apart.py")
    assert module.VALUE == 7 and str(folder) not in sys.path
    with pytest.raises(ModuleNotFoundError, match="not_there"):  # a missing package is still missing
        (folder / "other_kept_apart.py").write_text("import not_there\n")
        test_imports._import_beside_its_siblings("tools.checkpoint.other_kept_apart", folder / "other_kept_apart.py")
