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
