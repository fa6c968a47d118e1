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
    assert "--use-distributed-optimizer shards" in resume.not_for(layouts.get("tp2"), "")


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
