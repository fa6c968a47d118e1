"""Hugging Face weights in (megaport.train.hf_in): the docs' conversion and launch commands, what a
tree without the loader says, the tiny model transformers makes, and (full clone) the round trip
on a ported core 0.13 tree: Megatron's loss on the converted weights is transformers'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaport.train import hf_in, hf_models


def _tree(tmp_path, *files: str, parser: str = "group.add_argument('--rotary-base', type=int)\n",
          entry_point: bool = True) -> str:
    if entry_point:
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pretrain_gpt.py").write_text("")
    for name in files:
        path = tmp_path / "tools" / "checkpoint" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    arguments = tmp_path / "megatron" / "training" / "arguments.py"
    arguments.parent.mkdir(parents=True, exist_ok=True)
    arguments.write_text(parser)
    return str(tmp_path)


def test_where_upstream_removed_the_llama_loader_its_weights_come_in_through_megatron_bridge(tmp_path):
    """main since 39ec5ebeb4 (2026-05): no loader_llama_mistral.py; docs/llama_mistral.md converts with
    Megatron-Bridge's convert_checkpoints.py import (one rank's checkpoint, no parallel sizes)."""
    tree = _tree(tmp_path, "convert.py", "saver_core.py", "loader_core.py", "loader_mixtral_hf.py")
    assert hf_in.through_bridge(tree, "llama") and hf_in.absent(tree, "llama") is None
    assert not hf_in.through_bridge(tree, "mixtral")  # its loader is there
    cpu = hf_in.convert_command(tree, "llama", "HF", "OUT", 2, gpu=False)
    gpu = hf_in.convert_command(tree, "llama", "HF", "OUT", 2, gpu=True)
    assert cpu[1:4] == ["-m", "megaport.train.launch", "--cpu"] and cpu[4].endswith("bridge_convert.py")
    assert gpu[1].endswith("bridge_convert.py") and "megaport.train.launch" not in gpu
    for argv in (cpu, gpu):
        flags = " ".join(argv)
        assert "import --hf-model HF --megatron-path OUT --torch-dtype float32" in flags
        assert "--target-tensor-parallel-size" not in flags and "--loader" not in flags
    assert hf_in.absent(_tree(tmp_path, "loader_llama_mistral.py"), "llama") is None
    assert not hf_in.through_bridge(str(tmp_path), "llama")  # the loader is back: upstream's converter


def test_a_machine_without_megatron_bridge_is_told_what_to_install(tmp_path):
    missing = hf_in.missing_packages(bridge=True, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert "megatron-bridge" in missing or __import__("importlib").util.find_spec("megatron.bridge") is not None
    assert "megatron-bridge" not in hf_in.missing_packages(bridge=False)


def test_a_tree_whose_parser_cannot_set_ropes_base_lists_the_row_not_fails_it(tmp_path):
    """main 2024-06-04 … 06-27: the Llama 3 loader came before the parser had --rotary-base
    (3da17a326f), so the converted model ran RoPE at base 10000, 2.9 % off transformers' loss."""
    tree = _tree(tmp_path, "loader_llama_mistral.py", parser="group.add_argument('--rotary-percent')\n")
    why = hf_in.absent(tree, "llama")
    assert "--rotary-base" in why and "parser" in why


def test_a_tree_older_than_the_loader_is_not_told_of_its_removal(tmp_path):
    """main 2023-10 has no Llama loader yet: its report said upstream removed it in May 2026."""
    why = hf_in.absent(_tree(tmp_path, "util.py", "loader_megatron.py"), "llama")
    assert "loader_llama_mistral.py" in why and "2026" not in why and "Megatron-Bridge" not in why


def test_a_branch_without_the_entry_points_lists_the_rows_not_fails_them(tmp_path):
    """The nano-v3-vl snapshot (2026-04-21) kept tools/checkpoint but not pretrain_gpt.py (nor the
    model_provider.py its saver imports): its rows failed in the converter."""
    tree = _tree(tmp_path, "saver_core.py", "loader_llama_mistral.py", "loader_mixtral_hf.py", entry_point=False)
    for family in hf_in.SOURCES:
        assert "no pretrain_gpt.py" in hf_in.absent(tree, family)
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert all(hf_in.absent(tree, family) is None for family in hf_in.SOURCES)


def test_the_saver_is_the_eras_core_format_one(tmp_path):
    assert hf_in.saver(_tree(tmp_path / "new", "saver_core.py")) == "core"
    assert hf_in.saver(_tree(tmp_path / "old", "saver_mcore.py")) == "mcore"


def test_the_conversion_is_the_docs_command_through_megaports_launcher_on_the_cpu(tmp_path):
    tree = _tree(tmp_path, "saver_core.py", "loader_llama_mistral.py")
    cpu = hf_in.convert_command(tree, "llama", "HF", "OUT", 2, gpu=False)
    gpu = hf_in.convert_command(tree, "llama", "HF", "OUT", 2, gpu=True)
    assert cpu[1:5] == ["-m", "megaport.train.launch", "--cpu", "tools/checkpoint/convert.py"]
    assert gpu[1] == "tools/checkpoint/convert.py" and "megaport.train.launch" not in gpu
    for argv in (cpu, gpu):
        flags = " ".join(argv)
        assert "--loader llama_mistral --checkpoint-type hf --model-size llama3" in flags
        assert "--saver core --load-dir HF --save-dir OUT --tokenizer-model HF --target-tensor-parallel-size 2" in flags
        assert "--saver-transformer-impl" not in flags  # the docs' command: the series serve its default


def test_a_loader_that_names_llama3_by_size_gets_the_name_its_docs_use(tmp_path):
    """core 0.8's loader_llama_mistral has llama3-8B, not llama3 (its docs: --model-size llama3-8B)."""
    tree = _tree(tmp_path, "saver_mcore.py")
    (tmp_path / "tools" / "checkpoint" / "loader_llama_mistral.py").write_text(
        "choices=['llama2-7B', 'llama3-8B', 'llama3-70B', 'mistral-7B']")
    argv = hf_in.convert_command(tree, "llama", "HF", "OUT", 1, gpu=True)
    assert argv[argv.index("--model-size") + 1] == "llama3-8B" and argv[argv.index("--saver") + 1] == "mcore"


def test_the_launch_is_the_docs_flags_in_fp32_for_one_iteration_at_the_tp_size():
    argv = hf_in.launch_command("llama", "HF", "CKPT", "DOC", 2, gpu=False)
    flags = " ".join(argv)
    assert argv[argv.index("--nproc_per_node") + 1] == "2"
    assert "--tensor-model-parallel-size 2" in flags and "--use-checkpoint-args" in flags
    assert "--load CKPT" in flags and "--data-path DOC" in flags and "--train-iters 1" in flags
    assert "--bf16" not in flags and "--fp16" not in flags  # the same numbers as transformers' fp32
    assert "--cpu pretrain_gpt.py" in flags
    assert "--num-layers" not in flags  # --use-checkpoint-args reads it from the converter's checkpoint
    bridged = " ".join(hf_in.launch_command("llama", "HF", "CKPT", "DOC", 2, gpu=False, bridge=True))
    assert f"--num-layers {hf_models.LAYERS}" in bridged and f"--hidden-size {hf_models.HIDDEN}" in bridged


def _made(family: str, folder):
    """``python -m megaport.train.hf_models FAMILY FOLDER``, as a user runs it: (its document, the saved config)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-m", "megaport.train.hf_models", family, str(folder)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), json.loads((folder / "config.json").read_text())


def test_the_tiny_llama_is_what_transformers_saves_and_its_loss_is_over_the_datasets_sample(tmp_path):
    made, config = _made("llama", tmp_path)
    assert config["num_key_value_heads"] == hf_models.GROUPS and not config["tie_word_embeddings"]
    assert len(made["document"]) == hf_models.SEQ and 0 < made["loss"] < 10
    assert (tmp_path / "tokenizer.json").exists()


@pytest.mark.fullclone
def test_llama_weights_come_into_a_ported_core_013_tree_with_transformers_loss(full_clone, tmp_path):
    """Upstream core_v0.13.0, ported: its docs' converter command, then pretrain_gpt.py at TP1."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from support.porting import port

    tree = tmp_path / "tree"
    code, _, output = port(full_clone, "core_v0.13.0", tree)
    assert code == 0, output
    compared = hf_in.round_trip(str(tree), "llama", 1, str(tmp_path / "work"))
    assert compared["problems"] == [], compared
    assert compared["relative_difference"] <= hf_in.TOLERANCE


def test_a_converter_that_exits_0_having_written_nothing_is_an_error_naming_why(tmp_path):
    """upstream's convert.py exits 0 when its saver process dies (core 0.16.1's saver: no data-parallel group)."""
    tree = _tree(tmp_path / "tree", "saver_core.py", "loader_llama_mistral.py")
    (tmp_path / "tree" / "tools" / "checkpoint" / "convert.py").write_text(
        "print('Traceback (most recent call last):')\n"
        "print('AssertionError: data parallel group is not initialized')\n")
    made = tmp_path / "work" / "hf-llama"
    made.mkdir(parents=True)
    (made / "made.json").write_text(json.dumps({"document": list(range(3, 67)), "loss": 6.9, "transformers": "5"}))
    with pytest.raises(RuntimeError, match="wrote no checkpoint .*: AssertionError: data parallel group is not init"):
        hf_in.round_trip(tree, "llama", 1, str(tmp_path / "work"), gpu=True)


def test_each_family_is_a_row_and_mixtral_is_converted_by_its_own_loader_with_the_docs_saver(tmp_path):
    """examples/mixtral/README.md: --loader loader_mixtral_hf --saver mcore (every era: convert.py maps
    mcore to core from core 0.13) --target-expert-parallel-size N; a tree without the loader says so."""
    source = hf_in.SOURCES["mixtral"]
    assert source.loader == "loader_mixtral_hf" and source.saver == "mcore" and (1, 2) in source.layouts
    assert "examples/mixtral/README.md" in source.docs
    assert "loader_mixtral_hf.py" in hf_in.absent(_tree(tmp_path / "bare", "saver_core.py"), "mixtral")
    tree = _tree(tmp_path / "tree", "saver_core.py", "loader_mixtral_hf.py")
    assert hf_in.absent(tree, "mixtral") is None
    flags = " ".join(hf_in.convert_command(tree, "mixtral", "HF", "OUT", 1, gpu=False, ep=2))
    assert "--model-type GPT --loader loader_mixtral_hf --saver mcore --load-dir HF --save-dir OUT" in flags
    assert "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --target-expert-parallel-size 2" in flags
    # the Llama docs' command sets no expert-parallel size
    assert "--target-expert-parallel-size" not in " ".join(hf_in.convert_command(
        _tree(tmp_path / "llama", "saver_core.py", "loader_llama_mistral.py"), "llama", "HF", "OUT", 2, gpu=False))


def test_the_mixtral_launch_is_the_finetuning_scripts_flags_with_the_tiny_models_sizes():
    argv = hf_in.launch_command("mixtral", "HF", "CKPT", "DOC", 1, gpu=False, ep=2)
    flags = " ".join(argv)
    assert argv[argv.index("--nproc_per_node") + 1] == "2"  # TP1 x EP2
    assert "--tensor-model-parallel-size 1 --expert-model-parallel-size 2" in flags
    assert argv[argv.index("--global-batch-size") + 1] == "2"  # one sample a data-parallel rank
    assert "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss" in flags
    assert "--moe-token-dispatcher-type alltoall" in flags and "--use-mcore-models" in flags
    assert "--moe-router-pre-softmax" not in flags  # Megatron's default router is transformers' Mixtral's
    assert "--moe-grouped-gemm" not in flags and "--bf16" not in flags  # fp32: upstream's grouped GEMM is bf16 only
    for flag in hf_in.SOURCES["mixtral"].size_flags:
        assert argv[argv.index(flag) + 1] == str(hf_models.SIZES["mixtral"][flag])
    assert "--expert-model-parallel-size" not in " ".join(hf_in.launch_command("llama", "HF", "CKPT", "DOC", 2, gpu=False))


def test_a_rows_literal_launch_flags_agree_with_the_tiny_models_sizes():
    """A flag the docs give literally (Mixtral's --num-experts 8) must be the tiny model's too, and a
    size flag is never also a literal one."""
    for family, source in hf_in.SOURCES.items():
        sizes = hf_models.SIZES[family]
        flags = list(source.launch_flags)
        for flag in source.size_flags:
            assert flag in sizes and flag not in flags, (family, flag)
        for flag, value in sizes.items():
            if flag in flags:
                assert flags[flags.index(flag) + 1] == str(value), (family, flag)
        assert set(source.layouts) >= {(1, 1), (2, 1)} and family in hf_models.MODELS


def test_layouts_are_named_by_their_parallel_sizes():
    assert [hf_in.layout_name(tp, ep) for tp, ep in hf_in.SOURCES["mixtral"].layouts] == ["tp1", "tp2", "tp1-ep2"]


def test_the_tiny_mixtral_is_what_transformers_saves_with_bf16_exact_weights(tmp_path):
    made, config = _made("mixtral", tmp_path)
    assert config["num_local_experts"] == hf_models.EXPERTS == 8 and config["num_experts_per_tok"] == 2
    assert config["num_key_value_heads"] == hf_models.GROUPS and not config["tie_word_embeddings"]
    assert len(made["document"]) == hf_models.SEQ and 7.5 < made["loss"] < 10  # the weights' own, not ln(1024)
    import torch
    from safetensors.torch import load_file

    for name, weight in load_file(str(tmp_path / "model.safetensors")).items():
        assert torch.equal(weight.float(), weight.to(torch.bfloat16).float()), name  # the loader stores bf16
