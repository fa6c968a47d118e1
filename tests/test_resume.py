"""The resume check (train/checks/resume.py) and the launcher's guard against a resume that trains
nothing (train/resume_guard.py). The training itself runs in ``megaport verify --checks resume``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megaport.train import parity, plan, resume_guard
from megaport.train.checks import registry as checks
from megaport.train.checks import resume
from megaport.train.layouts import registry as layouts


def _run(iterations, losses=None, grad_norms=None, **more):
    return {"iterations": list(iterations), "losses": list(losses or [10.0 - 0.1 * i for i in iterations]),
            "grad_norms": list(grad_norms or [1.0 + 0.01 * i for i in iterations]), **more}


def _verdict(saved, resumed, whole=None):
    runs = {"uninterrupted": whole or _run(range(1, 31)), "saved": saved, "resumed": resumed}
    joined = {k: saved[k] + resumed[k] for k in ("iterations", "losses", "grad_norms")}
    return resume.resume_problems(runs, parity.loss_parity(joined, runs["uninterrupted"]))


def test_a_faithful_resume_holds():
    assert _verdict(_run(range(1, 16)), _run(range(16, 31))) == []


def test_a_resume_that_trains_nothing_is_an_error():
    nothing = _verdict(_run(range(1, 16)), {"iterations": [], "losses": [], "grad_norms": [],
                                            "error": "training process exited 1\n..."})
    assert nothing == ["the resumed run trained nothing after iteration 15: training process exited 1"]


def test_a_resume_that_starts_again_from_scratch_fails():
    problems = _verdict(_run(range(1, 16)), _run(range(1, 31)))
    assert any("not the uninterrupted run's" in p for p in problems)


def test_optimizer_state_lost_on_resume_fails():
    """A resume whose grad norms leave the uninterrupted run's (the optimizer's state dropped)."""
    whole = _run(range(1, 31))
    norms = [n * (1.2 if i > 16 else 1.0) for i, n in zip(whole["iterations"], whole["grad_norms"])]
    lost = _run(range(16, 31), whole["losses"][15:], norms[15:])
    assert any("grad norms differ" in p for p in _verdict(_run(range(1, 16)), lost, whole))


def test_upstreams_second_logged_loss_is_the_mean_of_two(tmp_path):
    """main's training_log keeps a run's first loss in the second log line; older eras do not."""
    whole = _run(range(1, 31))
    assert resume._expected(str(tmp_path), whole)["losses"] == whole["losses"]
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "training.py").write_text("    should_reset = not is_first_iteration\n")
    expected = resume._expected(str(tmp_path), whole)["losses"]
    assert expected[16] == pytest.approx((whole["losses"][15] + whole["losses"][16]) / 2)
    assert expected[:16] == whole["losses"][:16] and expected[17:] == whole["losses"][17:]


def test_resume_is_a_check_row_planned_where_ranks_shard_the_optimizer():
    assert checks.select("resume") == [resume.CHECK]
    assert resume.not_for(layouts.get("dp2-distopt"), "") is None
    assert resume.not_for(layouts.get("dp2-zero1"), "") is None  # DeepSpeed's ZeRO: one optimizer shard per rank
    assert "--use-distributed-optimizer or --zero-stage shards" in resume.not_for(layouts.get("tp2"), "")


def test_an_era_whose_optimizer_shards_nothing_resumes_in_tp2_and_on_one_rank(tmp_path):
    """2021's trees have neither the distributed optimizer nor DeepSpeed's ZeRO: without a stand-in
    no layout of theirs checked a resume, and their verify passed with none."""
    tree = tmp_path / "tree"
    (tree / "megatron").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    (tree / "megatron" / "arguments.py").write_text(
        "def add(group):\n    group.add_argument('--tensor-model-parallel-size')\n")
    assert resume.shards_nothing(str(tree))
    runs, _ = plan.plan(str(tree), [layouts.get("tp2")], [resume.CHECK])
    assert [r.id for r in runs] == ["gpt-tp2-resume"]
    assert "in tp2 where the era has neither" in resume.not_for(layouts.get("tp2-recompute"), str(tree))
    (tree / "megatron" / "arguments.py").write_text(
        "def add(group):\n    group.add_argument('--use-distributed-optimizer')\n")
    assert not resume.shards_nothing(str(tree))
    assert "in tp2 where the era has neither" in resume.not_for(layouts.get("tp2"), str(tree))


def test_verify_plans_resume_for_dp2_distopt(tmp_path):
    tree = tmp_path / "tree"
    (tree / "megatron" / "training").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    flags = ["--normalization", "--swiglu", "--group-query-attention", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--no-position-embedding", "--use-distributed-optimizer",
             "--tensor-model-parallel-size"]
    (tree / "megatron" / "training" / "arguments.py").write_text(
        "def add(group):\n" + "\n".join(f"    group.add_argument('{f}')" for f in flags) + "\n")
    runs, absent = plan.plan(str(tree), [layouts.get("dp2-distopt"), layouts.get("tp2")], [resume.CHECK])
    assert [r.id for r in runs] == ["llama-dp2-distopt-resume"]
    assert [(a.layout, a.check) for a in absent] == [("tp2", "resume")]


# -- the launcher's guard ------------------------------------------------------------------------
def test_training_asked_reads_load_iters_and_the_tracker(tmp_path):
    argv = ["--load", str(tmp_path), "--train-iters", "30"]
    assert resume_guard.training_asked(argv) == (str(tmp_path), 30)  # no tracker: upstream starts afresh
    (tmp_path / resume_guard.TRACKER).write_text("15")
    assert resume_guard.training_asked(argv) == (str(tmp_path), 30)
    (tmp_path / resume_guard.TRACKER).write_text("30")
    assert resume_guard.training_asked(argv) is None  # nothing left to train
    assert resume_guard.training_asked(argv + ["--finetune"]) == (str(tmp_path), 30)
    assert resume_guard.training_asked(["--train-iters", "30"]) is None
    (tmp_path / resume_guard.TRACKER).write_text("15")
    assert resume_guard.training_asked(argv + ["--skip-train"]) is None


def test_steps_are_counted_for_any_torch_optimizer(tmp_path):
    torch = pytest.importorskip("torch")
    steps = resume_guard.count_steps()
    argv = ["--load", str(tmp_path), "--train-iters", "30"]
    assert "no optimizer step ran" in resume_guard.trained_nothing(argv, steps)
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    torch.optim.AdamW([weight]).step()
    assert steps[0] == 1 and resume_guard.trained_nothing(argv, steps) is None


def test_the_launcher_exits_1_when_a_resume_trains_nothing(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('loaded nothing, trained nothing')\n")
    done = subprocess.run([sys.executable, "-m", "megaport.train.launch", str(script), "--load", str(tmp_path),
                           "--train-iters", "30"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "no optimizer step ran on this rank" in done.stderr
    done = subprocess.run([sys.executable, "-m", "megaport.train.launch", str(script), "--train-iters", "30"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_the_report_row_gives_the_layouts_figures_and_one_ranks():
    whole = _run(range(1, 31))
    compared = parity.loss_parity(whole, whole)
    compared["one_rank"] = dict(compared, max_relative_difference=0.02)
    row = resume.figures(compared)
    assert row.startswith("loss 0.0e+00") and "; one rank loss 2.0e-02" in row


# -- a checkpoint that cannot load: one line naming it, never a fresh start -----------------------
def _torch_dist_checkpoint(load, iteration=2):
    """A ``torch_dist``-format checkpoint folder as upstream writes it (torch.distributed.checkpoint), tracked."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    folder = load / f"iter_{iteration:07d}"
    dcp.save({"weight": torch.randn(64, 64), "bias": torch.randn(64)}, checkpoint_id=str(folder), no_dist=True)
    (load / resume_guard.TRACKER).write_text(str(iteration))
    return folder


def _torch_checkpoint(load, iteration=2):
    """A ``torch``-format checkpoint (mp_rank_00/model_optim_rng.pt), tracked."""
    torch = pytest.importorskip("torch")
    path = load / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": {"weight": torch.randn(64, 64)}, "iteration": iteration}, path)
    (load / resume_guard.TRACKER).write_text(str(iteration))
    return path


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _problem(load, *more):
    return resume_guard.checkpoint_problem(["--load", str(load), "--train-iters", "30", *more])


def test_a_whole_checkpoint_or_none_to_resume_is_no_problem(tmp_path):
    assert _problem(tmp_path / "absent") is None and _problem(tmp_path) is None  # a job's first run
    _torch_dist_checkpoint(tmp_path / "dist")
    _torch_checkpoint(tmp_path / "torch")
    assert _problem(tmp_path / "dist") is None and _problem(tmp_path / "torch") is None
    assert resume_guard.checkpoint_problem(["--train-iters", "30"]) is None


def test_a_truncated_distcp_file_is_named(tmp_path):
    folder = _torch_dist_checkpoint(tmp_path)
    shard = next(folder.glob("*.distcp"))
    _truncate(shard)
    problem = _problem(tmp_path)
    assert problem.startswith("> megaport: error: the run was given --load") and "\n" not in problem
    assert f"{shard} is truncated" in problem
    shard.unlink()
    assert f"{shard} is missing" in _problem(tmp_path)


def test_a_truncated_or_empty_torch_file_is_named(tmp_path):
    path = _torch_checkpoint(tmp_path)
    _truncate(path)
    assert f"{path} is truncated or corrupt" in _problem(tmp_path)
    path.write_bytes(b"")
    assert f"{path} is empty" in _problem(tmp_path)


def test_an_unreadable_dist_metadata_is_named(tmp_path):
    folder = _torch_dist_checkpoint(tmp_path)
    _truncate(folder / ".metadata")
    assert f"{folder / '.metadata'} is unreadable" in _problem(tmp_path)


def test_a_tracker_naming_a_missing_checkpoint_or_no_iteration_is_named(tmp_path):
    _torch_dist_checkpoint(tmp_path)
    tracker = tmp_path / resume_guard.TRACKER
    tracker.write_text("4")
    assert f"{tracker} names iteration 4, but its checkpoint {tmp_path / 'iter_0000004'} does not exist" in _problem(tmp_path)
    tracker.write_text("")  # a tracker write cut short
    assert f"{tracker} holds '', not an iteration" in _problem(tmp_path)
    tracker.write_text("2")
    assert "--ckpt-step 5, but its checkpoint" in _problem(tmp_path, "--ckpt-step", "5")
    (tmp_path / "global_step7").mkdir()  # Megatron-DeepSpeed's engine names its folders so
    tracker.write_text("7")
    assert _problem(tmp_path) is None


def test_the_launcher_refuses_a_truncated_checkpoint_before_the_script_runs(tmp_path):
    pytest.importorskip("torch")
    folder = _torch_dist_checkpoint(tmp_path / "ckpt")
    _truncate(next(folder.glob("*.distcp")))
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('started afresh')\n")
    done = subprocess.run([sys.executable, "-m", "megaport.train.launch", str(script), "--load", str(tmp_path / "ckpt"),
                           "--train-iters", "30"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "started afresh" not in done.stdout
    assert [line for line in done.stderr.splitlines() if line.strip()] == [_problem(tmp_path / "ckpt")]


def test_a_resume_leaves_out_the_example_s_flags_that_would_start_it_afresh(tmp_path):
    """main's Mixtral script ends ``--no-load-optim --no-load-rng`` (it starts from converted weights):
    a resume that kept them dropped Adam's moments and trained 11.5 % apart from the uninterrupted run."""
    from megaport.train import pretrain

    run = pretrain.Run(tree=str(tmp_path), family="mixtral")
    for resumed in (False, True):
        left_out = dict(resume._checkpoint_run(run, str(tmp_path / "ckpt"), resumed).left_out)
        assert {"--no-load-optim", "--no-load-rng", "--finetune", "--no-save-optim", "--no-save-rng"} <= set(left_out)


def test_the_forks_distributed_optimizer_layout_is_not_resumed_under_deepspeeds_engine(tmp_path):
    """Megatron-DeepSpeed under its engine: the optimizer is DeepSpeed's, and the fork's save asked it
    for Megatron's distributed optimizer's parameter state (mds-2024-12: AttributeError
    'save_parameter_state'); its ZeRO checkpoints are resumed in dp2-zero1."""
    from test_deepspeed_train import fork_tree

    tree = str(fork_tree(tmp_path / "tree"))
    assert "DeepSpeed's engine" in resume.not_for(layouts.get("dp2-distopt"), tree)
    assert resume.not_for(layouts.get("dp2-zero1"), tree) is None
