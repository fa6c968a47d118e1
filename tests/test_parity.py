"""Loss parity's verdict on two runs' logs: it fails on a grad norm, a loss or a window that
does not learn, and holds for runs that agree within rounding."""

from __future__ import annotations

from megaport.train import parity


def _run(losses, norms, start=1):
    return {"iterations": list(range(start, start + len(losses))), "losses": list(losses), "grad_norms": list(norms)}


LEARNING = [6.0 - 0.04 * i for i in range(60)]  # falls 39 %
NORMS = [1.5 - 0.005 * i for i in range(60)]


def _problems(ported, upstream):
    compared = parity.loss_parity(ported, upstream)
    return compared, parity.parity_problems(compared, min(len(ported["losses"]), len(upstream["losses"])))


def test_runs_that_agree_within_rounding_hold():
    compared, problems = _problems(_run([v * (1 + 1e-5) for v in LEARNING], [round(n, 3) for n in NORMS]),
                                   _run(LEARNING, NORMS))
    assert problems == [], problems
    assert compared["loss_drop"] > 0.3 and compared["grad_norm_compared"]


def test_a_hundredfold_grad_norm_fails_though_the_loss_agrees():
    compared, problems = _problems(_run(LEARNING, [n * 100 for n in NORMS]), _run(LEARNING, NORMS))
    assert compared["max_relative_difference"] == 0
    assert len(problems) == 1 and "grad norms differ by up to 9900.00%" in problems[0], problems


def test_a_loss_two_percent_off_fails():
    _, problems = _problems(_run([v * 1.02 for v in LEARNING], NORMS), _run(LEARNING, NORMS))
    assert len(problems) == 1 and "losses differ by up to 2.00%" in problems[0], problems


def test_a_window_where_the_model_does_not_learn_proves_nothing():
    flat = [5.96 - 0.0005 * i for i in range(60)]  # the 0.5 % of the example's learning rate
    _, problems = _problems(_run(flat, NORMS), _run(flat, NORMS))
    assert len(problems) == 1 and "fell by 0.5%" in problems[0], problems


def test_grad_norms_are_compared_only_where_both_runs_stepped():
    skipped = [None if i % 2 else n for i, n in enumerate(NORMS)]  # fp16 skipped every other step
    compared, problems = _problems(_run(LEARNING, skipped), _run(LEARNING, NORMS))
    assert problems == [] and len(compared["grad_norm_iterations"]) == 30
    compared, problems = _problems(_run(LEARNING, [None] * 60), _run(LEARNING, NORMS))
    assert not compared["grad_norm_compared"] and "only 0 iterations have a grad norm" in problems[0]


def test_iterations_only_one_run_logged_are_listed_and_too_few_common_ones_fail():
    compared, problems = _problems(_run(LEARNING[:20], NORMS[:20]), _run(LEARNING, NORMS))
    assert compared["only_upstream"] == list(range(21, 61))
    assert not any("logged by both" in p for p in problems)  # the shorter run's 20 are all compared
    compared, problems = _problems(_run(LEARNING, NORMS, start=100), _run(LEARNING, NORMS))
    assert compared["iterations"] == [] and any("only 0 iterations logged by both" in p for p in problems)


def test_an_era_whose_log_has_no_grad_norm_compares_the_loss_alone():
    """v2.0's log prints no grad norm: neither run has one, the loss decides (and still can fail)."""
    compared, problems = _problems(_run(LEARNING, [None] * 60), _run(LEARNING, [None] * 60))
    assert problems == [] and not compared["grad_norm_compared"] and not compared["grad_norm_logged"]
    _, problems = _problems(_run([v * 1.02 for v in LEARNING], [None] * 60), _run(LEARNING, [None] * 60))
    assert len(problems) == 1 and "losses differ" in problems[0]


def test_a_zero_grad_norm_agrees_with_zero_and_fails_against_anything_else():
    zeros = [0.0] + NORMS[1:]
    compared, problems = _problems(_run(LEARNING, zeros), _run(LEARNING, zeros))
    assert problems == [] and compared["grad_norm_max_relative_difference"] == 0
    compared, problems = _problems(_run(LEARNING, NORMS), _run(LEARNING, zeros))
    assert compared["grad_norm_max_relative_difference"] == float("inf") and len(problems) == 1


def test_the_report_says_a_loss_that_rose_with_a_plus():
    """A resumed window of 10 iterations may end above where it began: the report said "loss --1%"."""
    from megaport.train.checks.spec import loss_figures

    rising = parity.loss_parity(_run(LEARNING[::-1], NORMS), _run(LEARNING[::-1], NORMS))
    falling = parity.loss_parity(_run(LEARNING, NORMS), _run(LEARNING, NORMS))
    assert loss_figures(rising).endswith("loss +59%") and "--" not in loss_figures(rising)
    assert loss_figures(falling).endswith("loss -37%")
    assert parity.loss_change(0.0) == "loss +0%"
