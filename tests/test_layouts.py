"""Parallel layouts as a plan: Family x Layout x Check, the one torchrun launcher, and the commands
a layout gives a tree's entry point. The training itself runs in ``megaport verify`` (the smoke
suite's test_layouts.py); the full-clone test at the end trains layouts on a real upstream tree."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaport.errors import MegaportError
from megaport.train import example, plan, pretrain, torchrun
from megaport.train.checks import registry as checks
from megaport.train.layouts import registry as layouts
from megaport.train.layouts.spec import Layout
from megaport.train.families import spec as spec_module


def _tree(tmp_path, parser_flags: list, script: str | None = None):
    """A tree whose parser defines ``parser_flags`` (and the families' presence flags)."""
    tree = tmp_path / "tree"
    (tree / "megatron" / "training").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    lines = [f"    group.add_argument('{flag}')" for flag in parser_flags]
    (tree / "megatron" / "training" / "arguments.py").write_text("def add(group):\n" + "\n".join(lines) + "\n")
    if script:
        path = tree / "examples" / "mixtral" / "train_mixtral_8x7b_distributed.sh"
        path.parent.mkdir(parents=True)
        path.write_text(script)
    return str(tree)


LLAMA_FLAGS = ["--normalization", "--swiglu", "--group-query-attention", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--no-position-embedding"]


def test_every_layout_splits_over_two_or_more_ranks_and_says_what_it_is():
    for layout in layouts.LAYOUTS.values():
        assert layout.ranks.world >= 2, layout.name
        assert layout.summary and layout.flags, layout.name
        assert layout.families, f"{layout.name} names no family a default verify trains it with"
    assert {"tp2-sp", "cp2", "ep2", "pp2-vpp", "dp2-distopt", "two-nodes"} <= set(layouts.LAYOUTS)
    assert layouts.get("two-nodes").ranks == torchrun.Ranks(1, nodes=2)


def test_unknown_layout_or_check_is_a_one_line_error():
    with pytest.raises(MegaportError, match="unknown layout 'tp3'; known: tp2"):
        layouts.select("tp2,tp3")
    with pytest.raises(MegaportError, match="unknown check 'speed'"):
        checks.select("one-rank,speed")
    assert layouts.select("none") == [] and len(layouts.select("all")) == len(layouts.LAYOUTS)


def test_a_layout_is_absent_where_the_eras_parser_lacks_its_flags(tmp_path):
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", *LLAMA_FLAGS])
    runs, absent = plan.plan(tree, [layouts.get("tp2-sp"), layouts.get("cp2")], [checks.CHECKS["one-rank"]])
    assert [r.id for r in runs] == ["llama-tp2-sp-one-rank"]
    assert [(a.family, a.layout) for a in absent] == [("llama", "cp2")]
    assert "--context-parallel-size" in absent[0].why


def test_expert_layouts_need_a_model_with_experts(tmp_path):
    tree = _tree(tmp_path, ["--expert-model-parallel-size", "--num-experts", "--moe-router-topk", *LLAMA_FLAGS],
                 script="ARGS=(--num-experts 8 --moe-router-topk 2 --normalization RMSNorm)\n")
    ep2 = layouts.get("ep2")
    runs, absent = plan.plan(tree, [ep2], [checks.CHECKS["one-rank"]], models=["mixtral", "llama"])
    assert [r.id for r in runs] == ["mixtral-ep2-one-rank"]
    assert absent[0].family == "llama" and absent[0].why == "the model has no experts to split"


def test_grouped_gemm_experts_that_write_no_distributed_checkpoint_are_left_out_of_the_comparison(tmp_path):
    """Core 0.5-0.7's GroupedMLP writes no distributed checkpoint: every side builds the
    sequential experts and starts from one rank's checkpoint (from one initialisation, EP2 and one
    rank differ at their first iteration: each draws its experts its own way)."""
    from megaport.train.checks import one_rank

    tree = _tree(tmp_path, ["--use-dist-ckpt", "--expert-model-parallel-size", "--num-experts", "--moe-grouped-gemm",
                            *LLAMA_FLAGS],
                 script="ARGS=(--num-experts 8 --moe-grouped-gemm --normalization RMSNorm)\n")
    assert one_rank._unsaved_experts(tree, "mixtral") == ()
    experts = os.path.join(tree, "megatron", "core", "transformer", "moe", "experts.py")
    os.makedirs(os.path.dirname(experts))
    with open(experts, "w") as f:
        f.write("raise NotImplementedError('Currently distributed checkpointing is not supported for GroupedMLP')\n")
    ((flag, why),) = one_rank._unsaved_experts(tree, "mixtral")
    assert flag == "--moe-grouped-gemm" and "GroupedMLP" in why
    assert one_rank._unsaved_experts(tree, "llama") == () and one_rank._unsaved(tree) is None
    start = one_rank.Start(load="/ck", left_out=one_rank._unsaved_experts(tree, "mixtral"))
    argv = pretrain.command(start.of(pretrain.Run(tree=tree, family="mixtral", sizes=example.Sizes(steps=5))), tree).argv
    assert "--moe-grouped-gemm" not in argv and "--num-experts" in argv


def test_before_checkpoints_reshard_one_ranks_megatron_core_checkpoint_is_split_for_each_layout(tmp_path, monkeypatch):
    """Core 0.4-0.5 build the legacy model unless told ``--use-mcore-models`` (every layout run is
    told) and write one file per rank: one rank writes Megatron Core's model's checkpoint, and each
    layout loads megaport's split of it (one CPU draw split by rows was another model: core_v0.5.0
    Llama TP2 31 % in grad norm; the legacy model on one rank another still, 2.6 % in loss)."""
    from megaport.train.checks import legacy_reshard, one_rank
    from megaport.train.checks.spec import Context

    tree = _tree(tmp_path, ["--use-mcore-models", "--use-cpu-initialization", "--tensor-model-parallel-size",
                            "--num-query-groups", *LLAMA_FLAGS])
    written, splits = [], []
    monkeypatch.setattr(one_rank.pretrain, "run_pretrain", lambda run, env=None: written.append(run) or {})
    monkeypatch.setattr(legacy_reshard, "reshard_beside", lambda t, source, target, split: splits.append(split) or target)
    start = one_rank.shared_start(Context(tree, None, False, {}, str(tmp_path)),
                                  pretrain.Run(tree=tree, family="llama", sizes=example.Sizes(steps=5, heads=4)))
    ((writer,),) = [written]
    assert writer.save == start.load and writer.load is None
    run = pretrain.Run(tree=tree, family="llama", sizes=example.Sizes(steps=5, heads=4))
    one = pretrain.command(start.of(run), tree).argv
    tp2 = pretrain.command(start.of(dataclasses.replace(run, layout="tp2")), tree).argv
    assert example.flag_value(one, "--load") == start.load
    assert example.flag_value(tp2, "--load") == start.load + "-tp2-ep1" and splits == [legacy_reshard.Split(2, 1)]
    pp2 = pretrain.command(start.of(dataclasses.replace(run, layout="pp2")), tree).argv
    assert "--load" not in pp2  # stages are not split: pp2 is compared with unported upstream from the same seeds
    for argv in (one, tp2, pretrain.command(writer, tree).argv):
        assert argv.count("--use-mcore-models") == 1 and "--use-cpu-initialization" not in argv
        assert example.flag_value(argv, "--num-query-groups") == "2"  # Megatron Core's half the heads, on each side
    later = _tree(tmp_path / "later", ["--use-mcore-models", "--use-legacy-models", *LLAMA_FLAGS])
    assert one_rank._one_kind_of_model(later) == ()  # core 0.7 on: Megatron Core's is the default


def test_upstream_parity_is_planned_only_where_unported_upstream_trains_the_layout(tmp_path):
    # an era with the distributed optimizer: its resume is checked there, not in tp2 (resume.STAND_IN)
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
                            *LLAMA_FLAGS])
    runs, _ = plan.plan(tree, [layouts.get("tp2"), layouts.get("tp2-sp")], checks.select(None), models=["llama"])
    assert [r.id for r in runs] == ["llama-tp2-one-rank", "llama-tp2-upstream", "llama-tp2-sp-one-rank",
                                    "llama-tp2-sp-tp-replicas"]


def test_only_sequence_parallel_layouts_compare_the_tp_ranks_copies(tmp_path):
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", "--ckpt-format", *LLAMA_FLAGS])
    check = checks.CHECKS["tp-replicas"]
    assert "whole sequence" in check.not_for(layouts.get("tp2"), tree)
    assert check.not_for(layouts.get("tp2-sp"), tree) is None
    assert check.not_for(layouts.get("two-nodes"), tree) is None


def test_a_run_saving_one_file_per_rank_saves_in_the_legacy_format(tmp_path):
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", "--ckpt-format", *LLAMA_FLAGS])
    run = pretrain.Run(tree=tree, family="llama", save=str(tmp_path / "s"), save_per_rank=True)
    assert pretrain._format_flags(run, []) == ["--ckpt-format", "torch"]
    assert pretrain._format_flags(dataclasses.replace(run, save_per_rank=False), []) == ["--ckpt-format", "torch_dist"]
    with pytest.raises(ValueError):
        pretrain._format_flags(dataclasses.replace(run, load=str(tmp_path / "l")), [])


def _legacy_checkpoint(folder, ranks: dict, monkeypatch) -> None:
    """A legacy per-rank checkpoint: rank folder -> model state, pickled with an object of a module
    that is gone when it is read (as Megatron's arguments are to megaport's process)."""
    import types

    import torch

    gone = types.ModuleType("megatron_gone")

    class Arguments:
        pass

    Arguments.__module__, Arguments.__qualname__, gone.Arguments = "megatron_gone", "Arguments", Arguments
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "megatron_gone", gone)
        for rank, model in ranks.items():
            path = folder / "iter_0000030" / rank / "model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            torch.save({"model": model, "args": Arguments()}, path)


def test_tp_ranks_that_part_on_a_shared_weight_fail_the_check(tmp_path, monkeypatch):
    import torch

    from megaport.train.checks import one_rank, tp_replicas
    from megaport.train.checks.spec import Context

    norm = torch.ones(8)
    same = {"decoder.final_layernorm.weight": norm, "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(4, 8)}
    parted = {**same, "decoder.final_layernorm.weight": norm + 1e-3}
    for ranks, holds in (({"mp_rank_00": same, "mp_rank_01": dict(same)}, True),
                         ({"mp_rank_00": same, "mp_rank_01": parted}, False)):
        trained = []
        monkeypatch.setattr(one_rank, "base_run", lambda context, family, layout: pretrain.Run(tree=context.tree))
        monkeypatch.setattr(pretrain, "run_pretrain", lambda run, env, ranks=ranks: (
            trained.append(run), _legacy_checkpoint(Path(run.save), ranks, monkeypatch)))
        compared = tp_replicas.compare(Context(str(tmp_path), None, False, {}, str(tmp_path / str(holds))), "llama",
                                       layouts.get("tp2-sp"))
        assert trained[0].save_per_rank and trained[0].layout == "tp2-sp" and trained[0].load is None
        assert compared["shared_weights"] == 1  # the norm; the split fc1 weight is not a shared one
        assert (compared["problems"] == []) is holds, compared
        if not holds:
            assert "final_layernorm" in compared["problems"][0] and "1.0e-03" in compared["problems"][0]


def test_a_layout_the_eras_argument_checks_refuse_is_absent_with_why(tmp_path):
    flags = ["--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", *LLAMA_FLAGS]
    vpp = layouts.get("pp2-vpp")
    assert vpp.present(_tree(tmp_path / "new", flags), LLAMA_FLAGS) is None
    old = _tree(tmp_path / "old", flags)
    arguments = os.path.join(old, "megatron", "training", "arguments.py")
    with open(arguments, "a") as f:
        f.write("    assert pp > 2, 'pipeline-model-parallel size should be greater than 2 with ' \\\n"
                "        'interleaved schedule'\n")  # as core 0.6 writes it, over two lines
    assert "more than 2 pipeline stages" in vpp.present(old, LLAMA_FLAGS)


def test_optional_flags_come_where_the_era_has_them(tmp_path):
    dp2 = layouts.get("dp2-distopt")
    assert dp2.flags_for(_tree(tmp_path, ["--use-distributed-optimizer", "--overlap-grad-reduce"])) == [
        "--use-distributed-optimizer", "--overlap-grad-reduce"]


def test_node_commands_share_one_rendezvous_on_loopback():
    first, second = torchrun.node_commands(torchrun.Ranks(1, nodes=2), ["-m", "x"], port=29999)
    for rank, argv in enumerate((first, second)):
        assert argv[argv.index("--node_rank") + 1] == str(rank)
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"
        assert argv[argv.index("--master_port") + 1] == "29999"
        assert argv[-2:] == ["-m", "x"]
    (single,) = torchrun.node_commands(torchrun.Ranks(2), ["-m", "x"], port=29999)
    assert "--nnodes" not in single and single[single.index("--nproc_per_node") + 1] == "2"


def _command(tree, **run):
    sizes = example.Sizes(steps=5)
    return pretrain.command(pretrain.Run(tree=tree, sizes=sizes, family="llama", **run), tree, port=29500)


def test_a_layouts_flags_come_last_so_they_win_over_the_shrunk_one_rank_flags(tmp_path):
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", *LLAMA_FLAGS])
    cmd = _command(tree, layout="two-nodes")
    assert cmd.argv[cmd.argv.index("--nproc_per_node") + 1] == "1" and len(cmd.other_nodes) == 1
    tp = [cmd.argv[i + 1] for i, t in enumerate(cmd.argv) if t == "--tensor-model-parallel-size"]
    assert tp[-1] == "2" and "--sequence-parallel" in cmd.argv
    assert any(note.startswith("layout two-nodes:") for note in cmd.notes)


def test_runs_compared_across_layouts_pad_the_vocabulary_alike(tmp_path):
    """Upstream pads to its divisor x the TP size: one rank's 384 rows for 257 tokens are 512 at
    TP2, and core 0.6's checkpoint of one does not load in the other."""
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", *LLAMA_FLAGS])
    sizes = example.Sizes(steps=5, vocab_multiple=layouts.VOCAB_MULTIPLE)
    divisor = {}
    for layout in ("one-rank", "tp2", "pp2"):
        argv = pretrain.command(pretrain.Run(tree=tree, sizes=sizes, family="llama", layout=layout), tree).argv
        tp = int(layouts.get(layout).tensor_parallel)
        divisor[layout] = int(argv[len(argv) - 1 - argv[::-1].index("--make-vocab-size-divisible-by") + 1]) * tp
    assert set(divisor.values()) == {layouts.VOCAB_MULTIPLE} == {256}
    assert "--make-vocab-size-divisible-by" not in _command(tree).argv  # a run compared with none keeps upstream's


def test_checkpoint_flags_start_from_weights_only_in_the_distributed_format(tmp_path):
    tree = _tree(tmp_path, ["--ckpt-format", *LLAMA_FLAGS])
    saved = _command(tree, save="/ck").argv
    assert saved[saved.index("--save") + 1] == "/ck" and saved[saved.index("--save-interval") + 1] == "5"
    loaded = _command(tree, load="/ck").argv
    for flag in ("--finetune", "--no-load-optim", "--no-load-rng"):
        assert flag in loaded
    assert loaded[loaded.index("--ckpt-format") + 1] == "torch_dist"


def test_checkpoints_hold_weights_only_where_the_parser_can_say_so(tmp_path):
    tree = _tree(tmp_path, ["--ckpt-format", "--no-save-optim", *LLAMA_FLAGS])
    assert "--no-save-optim" in _command(tree, save="/ck").argv and "--no-save-optim" in _command(tree, load="/ck").argv
    assert "--no-save-optim" not in _command(tree).argv


@pytest.mark.parametrize("parser, mcore", [(["--use-dist-ckpt", "--use-mcore-models"], True),
                                           (["--use-dist-ckpt", "--use-mcore-models", "--use-legacy-models"], False),
                                           (["--ckpt-format", "--use-dist-ckpt", "--use-legacy-models"], False)])
def test_dist_checkpoints_build_mcore_models_where_the_era_builds_legacy_ones_by_default(tmp_path, parser, mcore):
    tree = _tree(tmp_path, [*parser, *LLAMA_FLAGS])
    for kind in ("save", "load"):
        assert ("--use-mcore-models" in _command(tree, **{kind: "/ck"}).argv) is mcore
    assert "--use-mcore-models" not in _command(tree).argv


def test_mcore_models_of_a_legacy_default_era_take_half_the_heads_as_query_groups(tmp_path):
    tree = _tree(tmp_path, ["--use-dist-ckpt", "--use-mcore-models", "--num-query-groups", *LLAMA_FLAGS])
    legacy = tmp_path / "tree" / "megatron" / "legacy" / "model" / "transformer.py"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("        " + spec_module._LEGACY_GQA_VIEW + "\n")
    assert example.flag_value(_command(tree).argv, "--num-query-groups") == "1"
    assert example.flag_value(_command(tree, load="/ck").argv, "--num-query-groups") == "2"


def test_a_legacy_only_era_compares_layouts_with_one_head_per_query_group(tmp_path):
    """main 2023-10 builds the legacy transformer alone (no --use-mcore-models), whose GQA view takes
    one group per TP rank: the family's one group died at TP 2 ("num_query_groups (1) must be a
    multiple of tensor_model_parallel_size (2)", 8 rows of e4-2023-09). Runs compared across layouts,
    the one-rank reference among them, take one head per group; the family's own run keeps one."""
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--num-query-groups", *LLAMA_FLAGS])
    legacy = tmp_path / "tree" / "megatron" / "model" / "transformer.py"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("        " + spec_module._LEGACY_GQA_VIEW + "\n")
    compared = example.Sizes(steps=5, vocab_multiple=256)

    def groups(**run):
        command = pretrain.command(pretrain.Run(tree=tree, family="llama", **run), tree, port=29500)
        return example.flag_value(command.argv, "--num-query-groups")

    assert groups(sizes=example.Sizes(steps=5)) == "1"
    assert groups(sizes=compared) == groups(sizes=compared, layout="tp2") == str(compared.heads)


def test_the_distributed_optimizer_leaves_out_the_overlapped_grad_reduce_of_the_era_that_got_it_wrong(tmp_path):
    """main 2023-09-07 … 09-27: the DDP's overlapped all-reduce and the distributed optimizer's own
    reduce-scatter both took the grad buffer (Llama DP2 grad norm half one rank's, unported too):
    the layout leaves --overlap-grad-reduce out there, says why, and keeps it once the DDP knows the
    distributed optimizer."""
    dp2 = layouts.get("dp2-distopt")
    tree = _tree(tmp_path, ["--use-distributed-optimizer", "--overlap-grad-reduce", *LLAMA_FLAGS])
    ddp = tmp_path / "tree" / "megatron" / "model" / "distributed.py"
    ddp.parent.mkdir(parents=True)
    ddp.write_text("def __init__(self, overlap_grad_reduce):\n    pass\n")
    assert "--overlap-grad-reduce" not in dp2.flags_for(str(tree))
    command = _command(tree, layout="dp2-distopt")
    assert "--overlap-grad-reduce" not in command.argv
    assert any(note.startswith("--overlap-grad-reduce left out (") and "9b8643cbf1" in note for note in command.notes)
    ddp.write_text("def __init__(self, overlap_grad_reduce, use_distributed_optimizer):\n    pass\n")
    assert "--overlap-grad-reduce" in dp2.flags_for(str(tree)) and not dp2.optional_left_out(str(tree))


def test_zero1_over_two_data_parallel_ranks_is_the_deepspeed_forks_alone(tmp_path):
    dp2 = layouts.get("dp2-zero1")
    assert dp2.micro_batch == 1 and "gpt" in dp2.families
    assert dp2.present(_tree(tmp_path / "up", LLAMA_FLAGS), []) == "the era's parser has no --zero-stage"
    assert dp2.present(_tree(tmp_path / "fork", ["--zero-stage", *LLAMA_FLAGS]), []) is None


def test_a_layout_that_needs_more_layers_gives_them_to_both_sides():
    assert layouts.get("pp2-vpp").sizes(example.Sizes(layers=2)).layers == 4
    assert Layout("x", "y", flags=("--a",)).sizes(example.Sizes(layers=2)).layers == 2


def test_a_deepened_model_learns_at_a_lower_rate_over_a_longer_window(tmp_path):
    """pp2-vpp's 4 layers: half the rate (spikes at the family's), twice the iterations (core 0.9
    fell 8.3 % in 30 at half the rate); both sides of the comparison take the same."""
    from megaport.train.checks import one_rank
    from megaport.train.checks.spec import Context

    tree = _tree(tmp_path, ["--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", *LLAMA_FLAGS])
    context = Context(tree, None, False, {}, str(tmp_path / "w"))
    plain, deep = (one_rank.base_run(context, "llama", layouts.get(name)) for name in ("pp2", "pp2-vpp"))
    assert (deep.sizes.layers, deep.sizes.steps) == (2 * plain.sizes.layers, 2 * plain.sizes.steps)
    assert deep.lr == pytest.approx(plain.lr / 2)


def test_print_command_prints_every_nodes_launcher(tmp_path):
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", *LLAMA_FLAGS])
    proc = subprocess.run([sys.executable, "-m", "megaport.train.pretrain", "--tree", tree, "--device", "cpu",
                           "--model", "llama", "--layout", "two-nodes", "--print-command", "--workdir",
                           str(tmp_path / "w")], capture_output=True, text=True, check=True)
    assert proc.stdout.count("--node_rank") == 2 and proc.stdout.count("# node ") == 2


@pytest.mark.fullclone
@pytest.mark.parametrize("names", ["tp2,pp2,dp2-distopt,two-nodes"])
def test_verify_trains_layouts_of_upstream_main_matching_one_rank(full_clone, tmp_path, names):
    """Upstream main's newest commit, ported: each layout trains and matches one rank."""
    from support.porting import port

    tree = tmp_path / "tree"
    code, _, output = port(full_clone, "main", tree)
    assert code == 0, output
    report = tmp_path / "verify.json"
    proc = subprocess.run([sys.executable, "-m", "megaport.cli", "verify", str(tree), "--device", "cpu", "--model",
                           "llama", "--layouts", names, "--checks", "one-rank", "-k", "layouts", "--json",
                           str(report)], capture_output=True, text=True, env={**os.environ}, timeout=3000)
    document = json.loads(report.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:]
    trained = document["device"]["layouts"]["llama"]
    assert sorted(trained) == sorted(names.split(","))
    for layout, compared in trained.items():
        assert not compared["one-rank"]["problems"], (layout, compared["one-rank"]["problems"])


@pytest.mark.fullclone
@pytest.mark.parametrize("fault, check", [
    # over 30 iterations an unmarked SP norm moves Llama only 8.8e-4 in loss and 3.1e-2 in grad norm
    # from one rank (2.9e-4 / 6.3e-3 when marked), inside those tolerances: the TP ranks' copies of
    # the norm part at the first step, and that check sees it
    ("sp-norm-grad", "tp-replicas"),
    ("cp-merge-without-lse", "one-rank")])
def test_a_fault_planted_in_a_layouts_path_fails_verify(full_clone, tmp_path, fault, check):
    """The SP norm's gradient not all-reduced, CP blocks merged without their log-sum-exp: the
    layout still trains, and a check of verify sees the fault."""
    from support.faults import LAYOUT_FAULTS, plant
    from support.porting import port

    layout, _ = LAYOUT_FAULTS[fault]
    tree = tmp_path / "tree"
    code, _, output = port(full_clone, "main", tree)
    assert code == 0, output
    plant(tree, fault)
    report = tmp_path / "verify.json"
    proc = subprocess.run([sys.executable, "-m", "megaport.cli", "verify", str(tree), "--device", "cpu", "--model",
                           "llama", "--layouts", layout, "--checks", check, "-k", "layouts", "--json",
                           str(report)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 1, proc.stdout[-3000:]
    compared = json.loads(report.read_text())["device"]["layouts"]["llama"][layout][check]
    assert compared.get("problems"), compared  # it trained, and the comparison failed


def test_a_tree_without_the_entry_point_plans_no_layout_and_says_why(tmp_path):
    tree = _tree(tmp_path, ["--tensor-model-parallel-size"])
    os.remove(os.path.join(tree, "pretrain_gpt.py"))
    runs, absent = plan.plan(tree, [layouts.get("tp2")], [checks.CHECKS["one-rank"]], models=["gpt"])
    assert runs == [] and "no pretrain_gpt.py" in absent[0].why


def test_the_eras_own_cp_gradient_scale_is_divided_out_of_the_layouts_grad_norm(tmp_path):
    """Before upstream's 3bdcbbbe5d (2024-09-05) its DDP divided by the data-parallel size without
    CP while the loss was multiplied by the CP size: measured on a 2024-06 tree, cp2's grad norms
    were 2.0x one rank's at a loss within 2.2e-4."""
    from megaport.train.checks import one_rank

    tree = _tree(tmp_path, ["--context-parallel-size", *LLAMA_FLAGS])
    ddp = os.path.join(tree, "megatron", "core", "distributed", "distributed_data_parallel.py")
    os.makedirs(os.path.dirname(ddp))
    with open(ddp, "w") as f:
        f.write("                data_parallel_world_size = parallel_state.get_data_parallel_world_size()\n")
    factor, why = one_rank.era_grad_scale(tree, layouts.get("cp2"))
    assert factor == 2 and "3bdcbbbe5d" in why
    assert one_rank.era_grad_scale(tree, layouts.get("tp2")) == (1, None)
    with open(ddp, "w") as f:  # upstream's fix
        f.write("data_parallel_world_size = parallel_state.get_data_parallel_world_size(\n"
                "    with_context_parallel=True\n)\n")
    assert one_rank.era_grad_scale(tree, layouts.get("cp2")) == (1, None)


def test_tp_layouts_of_an_era_whose_qkv_split_is_another_model_are_compared_with_upstream(tmp_path):
    """Megatron-DeepSpeed reads each TP rank's QKV rows as [queries; keys; values]: one rank's
    initialisation split by rows is another model at TP2 (measured 2024-12: 2.3 % apart by
    iteration 30 from one rank, 5e-4 from unported upstream in the same layout)."""
    from megaport.train.checks import one_rank

    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--zero-stage", *LLAMA_FLAGS])
    transformer = Path(tree, "megatron", "model", "transformer.py")
    transformer.parent.mkdir(parents=True)
    transformer.write_text("            each_hidden_size = mixed_x_layer.shape[-1] // 3\n")
    assert "[queries; keys; values]" in one_rank.not_for(layouts.get("tp2-recompute"), tree)
    assert one_rank.not_for(layouts.get("dp2-zero1"), tree) is None
    transformer.write_text("    (query_layer, key_layer, value_layer) = split_tensor_along_last_dim(mixed_x_layer, 3)\n")
    assert one_rank.not_for(layouts.get("tp2-recompute"), tree) is None


def test_tensor_parallel_layouts_are_absent_for_an_mla_that_builds_one_head(tmp_path):
    """Before 47ab878ae7 (2024-12-07) upstream's MLA builds one head only (core 0.9: "num_attention_heads
    (1) must be a multiple of tensor_model_parallel_size (2)"): its TP layouts are listed, not run."""
    from megaport.train.families import deepseek

    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
                            "--multi-latent-attention", "--num-experts", *LLAMA_FLAGS])
    mla = Path(tree, deepseek._MLA)
    mla.parent.mkdir(parents=True)
    mla.write_text("k = torch.cat([k_no_pe, k_pos_emb], dim=-1)\n")
    runs, absent = plan.plan(tree, [layouts.get("tp2-sp"), layouts.get("pp2")], checks.select(None),
                             models=["deepseek"])
    assert [(a.layout, "one head" in a.why) for a in absent if not a.check] == [("tp2-sp", True)]
    assert {r.layout.name for r in runs} == {"pp2"}
    expanded = f"{deepseek._MLA_SHARED_ROPE_EXPANDED}-1, -1, self.num_attention_heads_per_partition, -1)\n"
    mla.write_text(expanded)
    runs, absent = plan.plan(tree, [layouts.get("tp2-sp")], checks.select(None), models=["deepseek"])
    assert {r.layout.name for r in runs} == {"tp2-sp"}


def test_tensor_parallel_layouts_are_absent_where_mla_asserts_tp_one(tmp_path):
    """From 47ab878ae7 (2024-12-07) MLA builds every head but asserts a TP size of 1 until ea94163be7
    (2025-02-02): core 0.10's DeepSeek tp2-sp died "MLA is not supported with Tensor Parallelism yet"."""
    from megaport.train.families import deepseek

    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
                            "--multi-latent-attention", "--num-experts", *LLAMA_FLAGS])
    mla = Path(tree, deepseek._MLA)
    mla.parent.mkdir(parents=True)
    expanded = f"{deepseek._MLA_SHARED_ROPE_EXPANDED}-1, -1, self.num_attention_heads_per_partition, -1)\n"
    mla.write_text('assert world_size == 1, "MLA is not supported with Tensor Parallelism yet, use EP"\n' + expanded)
    runs, absent = plan.plan(tree, [layouts.get("tp2-sp"), layouts.get("pp2")], checks.select(None),
                             models=["deepseek"])
    assert [(a.layout, "refuses tensor parallelism" in a.why) for a in absent if not a.check] == [("tp2-sp", True)]
    assert {r.layout.name for r in runs} == {"pp2"}
    mla.write_text(expanded)
    runs, absent = plan.plan(tree, [layouts.get("tp2-sp")], checks.select(None), models=["deepseek"])
    assert {r.layout.name for r in runs} == {"tp2-sp"}


def test_mixtral_layouts_are_compared_in_fp32_with_sequential_experts_where_grouped_gemm_takes_bf16_alone(tmp_path):
    """bf16 turned top-2 routing to other experts in core 0.8's ep2-tp2 (6.7 % in grad norm from one
    rank at one step); in fp32 it held at 2.0e-2. Core 0.5 … 0.8's grouped GEMM refuses fp32."""
    from megaport.train.checks import one_rank
    from megaport.train.checks.spec import Context

    tree = _tree(tmp_path, ["--expert-model-parallel-size", "--num-experts", "--moe-router-topk", "--moe-grouped-gemm",
                            *LLAMA_FLAGS])
    context = Context(tree, None, False, {}, str(tmp_path / "w"))
    left_out = dict(one_rank.base_run(context, "mixtral", layouts.get("ep2")).left_out)
    assert "--bf16" in left_out and "--moe-grouped-gemm" not in left_out
    arguments = Path(tree, "megatron", "training", "arguments.py")
    arguments.write_text(arguments.read_text() + "assert args.bf16, 'Currently GroupedGEMM for MoE only supports bf16 dtype.'\n")
    left_out = dict(one_rank.base_run(context, "mixtral", layouts.get("ep2")).left_out)
    assert {"--bf16", "--moe-grouped-gemm"} <= set(left_out)
    assert "--bf16" not in dict(one_rank.base_run(context, "llama", layouts.get("tp2")).left_out)


def test_mixtral_layouts_build_sequential_experts_where_grouped_mlp_itself_takes_bf16_alone(tmp_path):
    """main 2025-12-22 … 2026-03-04 (core 0.16.1): the argument check gone, GroupedMLP's forward still
    asserts bf16 (a tree without TE builds it): core 0.16.1's fp32 EP2 failed there."""
    from megaport.train.checks import one_rank
    from megaport.train.checks.spec import Context

    tree = _tree(tmp_path, ["--expert-model-parallel-size", "--num-experts", "--moe-router-topk", "--moe-grouped-gemm",
                            *LLAMA_FLAGS])
    context = Context(tree, None, False, {}, str(tmp_path / "w"))
    experts = Path(tree, "megatron", "core", "transformer", "moe", "experts.py")
    experts.parent.mkdir(parents=True)
    experts.write_text('        assert self.config.bf16, "Currently GroupedMLP for MoE only supports bf16."\n')
    assert {"--bf16", "--moe-grouped-gemm"} <= set(dict(one_rank.base_run(context, "mixtral", layouts.get("ep2")).left_out))


def test_the_way_back_is_planned_for_the_layouts_that_split_weights_where_checkpoints_reshard(tmp_path):
    flags = ["--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
             "--use-distributed-optimizer", *LLAMA_FLAGS]
    wanted = [layouts.get(n) for n in ("tp2", "tp2-sp", "pp2", "dp2-distopt")]
    check = checks.CHECKS["layout-change"]
    runs, absent = plan.plan(_tree(tmp_path / "dist", flags + ["--ckpt-format"]), wanted, [check])
    assert [r.id for r in runs] == ["llama-tp2-layout-change", "llama-pp2-layout-change"]
    assert {a.layout for a in absent} == {"tp2-sp", "dp2-distopt"}
    runs, absent = plan.plan(_tree(tmp_path / "legacy", flags), wanted, [check])
    assert runs == [] and "do not reshard" in next(a.why for a in absent if a.layout == "tp2")


def _continuations(tmp_path, monkeypatch, back_losses: list, layout: str = "tp2", writes: bool = True) -> tuple:
    """layout_change.compare with every run faked: the layout's and one rank's runs, then one rank
    from each one's checkpoint (``back_losses`` from the layout's); (the runs asked for, the comparison)."""
    from megaport.train.checks import layout_change, one_rank
    from megaport.train.checks.spec import Context

    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--ckpt-format", *LLAMA_FLAGS])
    steps = 30
    own = [10.0 * (1 - 0.02 * i) for i in range(steps)]
    trained = []

    def run_pretrain(run, env):
        trained.append(run)
        if run.save and writes:
            os.makedirs(run.save, exist_ok=True)
            Path(run.save, "latest_checkpointed_iteration.txt").write_text(str(run.sizes.steps))
        losses = back_losses if run.load and "written-llama-tp2" in run.load else own
        return {"iterations": list(range(1, steps + 1)), "losses": losses, "grad_norms": [1.0] * steps}

    monkeypatch.setattr(one_rank, "_SHARED", {})
    monkeypatch.setattr(one_rank, "base_run", lambda context, family, layout: pretrain.Run(
        tree=context.tree, family=family, sizes=example.Sizes(steps=steps)))
    monkeypatch.setattr(pretrain, "run_pretrain", run_pretrain)
    context = Context(tree, None, False, {}, str(tmp_path / "work"))
    if layout == "tp2-then-pp2":  # two layouts of one size: the second shares one rank's written run
        layout_change.compare(context, "llama", layouts.get("tp2"))
        layout = "pp2"
    return trained, layout_change.compare(context, "llama", layouts.get(layout))


def test_one_rank_loads_the_layouts_checkpoint_and_trains_as_from_its_own(tmp_path, monkeypatch):
    own = [10.0 * (1 - 0.02 * i) for i in range(30)]
    trained, compared = _continuations(tmp_path, monkeypatch, [x * 1.001 for x in own])
    assert compared["problems"] == []
    shared, layout, reference, back, yardstick = trained
    assert shared.save and not shared.load  # the shared start one rank writes
    assert layout.layout == "tp2" and layout.save and layout.load == shared.save
    assert reference.layout == "one-rank" and reference.save and reference.save != layout.save
    assert layout.sizes.steps == reference.sizes.steps == 4  # written after a few steps, its own runs
    assert (back.layout, back.load, yardstick.layout, yardstick.load) == ("one-rank", layout.save, "one-rank",
                                                                          reference.save)


def test_a_layout_checkpoint_that_loads_another_model_fails_the_way_back(tmp_path, monkeypatch):
    own = [10.0 * (1 - 0.02 * i) for i in range(30)]
    _, compared = _continuations(tmp_path, monkeypatch, [x * 1.03 for x in own])
    assert any("losses differ by up to 3.00%" in p for p in compared["problems"]), compared["problems"]


def test_layouts_of_one_size_share_one_ranks_checkpoint_and_each_loads_what_was_written(tmp_path, monkeypatch):
    """pp2 after tp2 (the same sizes): one rank's written run is shared, and pp2's yardstick loads the
    folder that run wrote (core 0.6-0.7: it once loaded a folder never written, and trained from a
    random start, 9 % apart)."""
    trained, compared = _continuations(tmp_path, monkeypatch, [10.0 * (1 - 0.02 * i) for i in range(30)],
                                       layout="tp2-then-pp2")
    written = {run.save for run in trained if run.save}
    assert all(run.load in written for run in trained if run.load and "written" in run.load)
    assert sum(1 for run in trained if run.save and run.layout == "one-rank" and "written" in run.save) == 1


def test_a_layout_whose_run_wrote_no_checkpoint_is_an_error_not_a_random_start(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="wrote no checkpoint"):
        _continuations(tmp_path, monkeypatch, [1.0] * 30, writes=False)


def test_the_way_back_holds_where_the_loss_rises_a_little_over_its_ten_iterations(tmp_path, monkeypatch):
    """core 2024-02: one rank from either checkpoint rose 1.1 % over 10 iterations, alike on both sides."""
    rising = [5.0 * (1 + 0.001 * i) for i in range(30)]
    from megaport.train.checks import layout_change, one_rank

    monkeypatch.setattr(layout_change, "_on_one_rank", lambda context, family, sized_for, written: {
        "iterations": list(range(1, 31)), "losses": rising, "grad_norms": [1.0] * 30})
    monkeypatch.setattr(layout_change, "_written", lambda *args: pretrain.Run(tree=str(tmp_path)))
    from megaport.train.checks.spec import Context

    compared = layout_change.compare(Context(str(tmp_path), None, False, {}, str(tmp_path)), "llama",
                                     layouts.get("tp2"))
    assert compared["problems"] == []


def test_the_shared_start_is_drawn_on_the_device_where_the_era_drew_on_the_cpu_by_default(tmp_path, monkeypatch):
    """main 2024-03-19 … 03-27 drew its weights on the CPU unless --use-gpu-initialization: the one
    rank that writes the shared start asks for the device draw every other era makes (from the CPU
    draw GPT TP2xPP2 and one rank drifted 7.4 % apart in fp16, on the next era's code too)."""
    from megaport.train import pretrain
    from megaport.train.checks import one_rank
    from megaport.train.checks.spec import Context

    written = []
    monkeypatch.setattr(pretrain, "run_pretrain", lambda run, env=None, **kw: written.append(run) or {})
    for flags, drawn in ((["--use-gpu-initialization", "--use-dist-ckpt"], True), (["--use-dist-ckpt"], False)):
        tree = _tree(tmp_path / str(drawn), ["--tensor-model-parallel-size", *flags, *LLAMA_FLAGS])
        context = Context(tree, None, False, {}, str(tmp_path / f"w{drawn}"))
        one_rank.shared_start(context, one_rank.base_run(context, "llama", layouts.get("tp2")))
        extra = [f for added, _ in written[-1].extra for f in added]
        assert ("--use-gpu-initialization" in extra) is drawn


def test_an_era_without_the_layouts_families_trains_it_with_gpt(tmp_path):
    """main 2022-05 has sequence parallelism and the distributed optimizer but no Llama (no
    --swiglu): GPT trains those layouts; EP, which needs experts, stays absent."""
    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
                            "--pipeline-model-parallel-size"])
    runs, absent = plan.plan(tree, [layouts.get(n) for n in ("tp2-sp", "dp2-distopt", "pp2", "ep2")],
                             [checks.CHECKS["one-rank"], checks.CHECKS["upstream"]])
    assert [r.id for r in runs] == ["gpt-tp2-sp-one-rank", "gpt-dp2-distopt-one-rank", "gpt-dp2-distopt-upstream",
                                    "gpt-pp2-upstream"]  # 2022's pipeline stages: against upstream (no reshard)
    assert not any(a.layout == "ep2" for a in absent)  # no experts, no family to train it: not planned at all
    with_llama = _tree(tmp_path / "llama", ["--tensor-model-parallel-size", "--sequence-parallel", *LLAMA_FLAGS])
    assert [r.id for r in plan.plan(with_llama, [layouts.get("tp2-sp")], [checks.CHECKS["one-rank"]])[0]] == \
        ["llama-tp2-sp-one-rank"]


def test_the_tp_ranks_copies_are_found_in_a_legacy_models_nested_state(tmp_path):
    """2022's GPT saves ``model -> language_model -> encoder -> layers.0.input_layernorm.weight``:
    the copies are read from nested dicts too (they were 'no weight shared ... found')."""
    import torch

    from megaport.train.checks import tp_replicas

    for rank, scale in ((0, 1.0), (1, 1.5)):
        folder = tmp_path / "iter_0000003" / f"mp_rank_0{rank}"
        folder.mkdir(parents=True)
        encoder = {"layers.0.input_layernorm.weight": torch.ones(4) * scale, "layers.0.mlp.dense_4h_to_h.weight":
                   torch.full((4, 4), float(rank))}
        torch.save({"model": {"language_model": {"encoder": encoder}}}, folder / "model_optim_rng.pt")
    copies = tp_replicas._copies(str(tmp_path))
    assert list(copies) == ["language_model.encoder.layers.0.input_layernorm.weight"]
    assert [float(t[0]) for t in copies["language_model.encoder.layers.0.input_layernorm.weight"]] == [1.0, 1.5]


def test_tp_replicas_reads_the_checkpoint_deepspeeds_engine_writes(tmp_path):
    """The Megatron-DeepSpeed fork under DeepSpeed's engine saves global_step<N>/mp_rank_<tp>_model_states.pt,
    the model under "module" (the check said 'the layout's run wrote no checkpoint'); the newest
    step is the largest number, not the last name (global_step10 sorts before global_step3)."""
    import torch

    from megaport.train.checks import tp_replicas

    for step, scale in ((3, 9.0), (10, 1.5)):
        folder = tmp_path / f"global_step{step}"
        folder.mkdir()
        for rank in (0, 1):
            encoder = {"layers.0.input_layernorm.bias": torch.ones(4) * (scale if rank else 1.0),
                       "layers.0.mlp.dense_4h_to_h.weight": torch.full((4, 4), float(rank))}
            torch.save({"module": {"language_model": {"encoder": encoder}}, "optimizer": None, "iteration": step},
                       folder / f"mp_rank_0{rank}_model_states.pt")
            torch.save({"optimizer_state_dict": {}}, folder / f"zero_pp_rank_0_mp_rank_0{rank}_optim_states.pt")
    (tmp_path / "latest").write_text("global_step10")
    copies = tp_replicas._copies(str(tmp_path))
    assert list(copies) == ["language_model.encoder.layers.0.input_layernorm.bias"]
    assert [float(t[0]) for t in copies["language_model.encoder.layers.0.input_layernorm.bias"]] == [1.0, 1.5]


def test_selective_recomputation_leaves_out_the_scripts_recompute_method(tmp_path):
    """2022's GPT script says --activations-checkpoint-method uniform; upstream refuses a method
    beside --recompute-granularity selective ('recompute method is not yet supported')."""
    from megaport.train.checks import one_rank
    from megaport.train.checks.spec import Context

    tree = _tree(tmp_path, ["--tensor-model-parallel-size", "--recompute-granularity"])
    context = Context(tree, None, False, {}, str(tmp_path / "w"))
    left_out = dict(one_rank.base_run(context, "gpt", layouts.get("tp2-selective")).left_out)
    assert {"--recompute-method", "--activations-checkpoint-method"} <= set(left_out)
    assert "--recompute-method" not in dict(one_rank.base_run(context, "gpt", layouts.get("tp2-recompute")).left_out)
