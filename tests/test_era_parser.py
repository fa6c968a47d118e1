"""The era's flags read from its own parser (core 0.16 on, where config dataclasses make flags):
where upstream's entry point stops before its parser, verify says why in one line, never reads
every flag as absent (which made 26.04-alpha's layouts vanish: its pretrain_gpt.py imports pandas)."""

from __future__ import annotations

import pytest

from megaport.errors import MegaportError
from megaport.train import example


def _tree(tmp_path, script: str):
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "argument_utils.py").write_text("")
    (tmp_path / "megatron" / "training" / "arguments.py").write_text("")
    (tmp_path / "pretrain_gpt.py").write_text(script)
    example._HELP_CACHE.pop(str(tmp_path), None)
    return str(tmp_path)


def test_the_era_s_generated_flags_come_from_its_parser(tmp_path):
    tree = _tree(tmp_path, "import argparse\nparser = argparse.ArgumentParser()\n"
                           "parser.add_argument('--tensor-model-parallel-size')\nparser.parse_known_args()\n")
    assert example.parser_has(tree, "--tensor-model-parallel-size")
    assert not example.parser_has(tree, "--context-parallel-size")


def test_an_entry_point_that_stops_before_its_parser_is_an_error_naming_the_package(tmp_path):
    tree = _tree(tmp_path, "import pandas_that_is_not_installed\n")
    with pytest.raises(MegaportError, match=r"stopped before its argument parser.*No module named "
                                            r"'pandas_that_is_not_installed' \(upstream imports it: pip install "
                                            r"pandas_that_is_not_installed\)"):
        example.parser_has(tree, "--tensor-model-parallel-size")


#: main 5f5741db9b's experts module, as far as its import goes (a module upstream never had)
BROKEN_EXPERTS = "import torch\n\nfrom megatron.core.backwards_compatibility_decorators import deprecated\n"
PARSING_SCRIPT = ("import megatron.core.transformer.moe.experts\nimport argparse\nparser = argparse.ArgumentParser()\n"
                  "parser.add_argument('--context-parallel-size')\nparser.parse_known_args()\n")


def _window_tree(tmp_path):
    tree = _tree(tmp_path, PARSING_SCRIPT)
    for package in ("megatron/core", "megatron/core/transformer", "megatron/core/transformer/moe"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "megatron/__init__.py").write_text("")
    (tmp_path / "megatron/core/utils.py").write_text("def deprecated(*args, **kwargs):\n    return lambda f: f\n")
    (tmp_path / "megatron/core/transformer/moe/experts.py").write_text(BROKEN_EXPERTS)
    return tree


def test_an_upstream_window_whose_imports_fail_everywhere_reads_its_parser_with_the_shim_that_mends_them(tmp_path):
    """5f5741db9b's unported tree imports nothing: its parser is read as the baseline runs it, with
    the window's shim (read without it, the era had no flags and 13 of its tests failed)."""
    tree = _window_tree(tmp_path)
    assert example.parser_has(tree, "--context-parallel-size")


def test_without_a_shim_for_it_the_trees_own_missing_module_is_named_as_upstreams_bug(tmp_path, monkeypatch):
    from megaport.train.shims import registry

    tree = _window_tree(tmp_path)
    monkeypatch.setattr(registry, "pick", lambda failures, have: None)
    with pytest.raises(MegaportError, match=r"No module named 'megatron\.core\.backwards_compatibility_decorators' "
                                            r"\(a module of the tree's own package: upstream's code at this commit\)"):
        example.parser_has(tree, "--context-parallel-size")
