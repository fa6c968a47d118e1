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


def _ported_tree(tmp_path, upstream_files: dict, ported_files: dict) -> str:
    """A git tree whose first commit is "upstream" (recorded in state.json as the unported commit)
    and whose second is a series' change of it."""
    import git

    from megaport.porttree import PortState, write_state

    repo = git.Repo.init(tmp_path / "tree")
    root = tmp_path / "tree"
    for files in (upstream_files, ported_files):
        for rel, text in files.items():
            path = root / rel
            if text is None:
                path.unlink()
                repo.index.remove([rel])
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            repo.index.add([rel])
        repo.index.commit("upstream" if files is upstream_files else "port",
                          author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
        if files is upstream_files:
            sha = repo.head.commit.hexsha
    write_state(root, PortState(upstream_url="u", upstream_ref="main", upstream_sha=sha, series="s",
                                branch="megaport/s", head=repo.head.commit.hexsha, patches=[], files=[]))
    return str(root)


def test_era_facts_come_from_the_unported_commit_not_the_ported_files(tmp_path):
    """A series that dropped upstream's Llama loader, the parser's --rotary-base or a family's entry
    point must fail that row in verify, not make it vanish as "this era has none"."""
    from megaport.train import hf_in
    from megaport.train.families import registry

    tree = _ported_tree(tmp_path,
                        {"tools/checkpoint/loader_llama_mistral.py": "'llama3'\n",
                         "tools/checkpoint/saver_core.py": "",
                         "pretrain_bert.py": "", "pretrain_t5.py": "", "pretrain_gpt.py": "",
                         "megatron/training/arguments.py": "group.add_argument('--rotary-base', type=int)\n"},
                        {"tools/checkpoint/loader_llama_mistral.py": None,
                         "pretrain_bert.py": None, "pretrain_t5.py": None, "pretrain_gpt.py": None,
                         "tools/checkpoint/saver_core.py": None,
                         "megatron/training/arguments.py": "# the series broke the parser\n"})
    assert tree_text(tree, "megatron/training/arguments.py").startswith("group.add_argument")
    assert hf_in.absent(tree, "llama") is None
    assert hf_in.saver(tree) == "core"
    for name in ("bert", "t5"):
        assert registry.get(name).present(tree) and registry.get(name).has_entry_point(tree)
