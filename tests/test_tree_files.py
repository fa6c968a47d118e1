"""The one reader of an upstream tree's files behind every "what does this era's code say" check."""

from megaport.train.tree_files import tree_says, tree_text


def test_tree_text_reads_the_first_candidate_the_tree_has(tmp_path):
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "arguments.py").write_text("old layout")
    assert tree_text(str(tmp_path), "megatron/training/arguments.py", "megatron/arguments.py") == "old layout"
    (tmp_path / "megatron" / "training").mkdir()
    (tmp_path / "megatron" / "training" / "arguments.py").write_text("new layout")
    assert tree_text(str(tmp_path), "megatron/training/arguments.py", "megatron/arguments.py") == "new layout"
    assert tree_text(str(tmp_path), "megatron/absent.py") is None


def test_tree_says_is_false_where_the_file_is_missing(tmp_path):
    (tmp_path / "t5_spec.py").write_text("layer_norm=TENorm,\n")
    assert tree_says(str(tmp_path), "t5_spec.py", "layer_norm=TENorm")
    assert not tree_says(str(tmp_path), "t5_spec.py", "layer_norm=FusedLayerNorm")
    assert not tree_says(str(tmp_path), "missing.py", "")
