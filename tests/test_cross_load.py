"""The cross-load check (train/checks/cross_load.py): unported upstream resumes the ported tree's
checkpoint and the ported tree resumes upstream's, each joined run held to the ported uninterrupted
run. The training itself runs in ``megaport verify --checks cross-load``."""

from __future__ import annotations

import dataclasses

from megaport.train import parity, pretrain
from megaport.train.checks import cross_load, resume
from megaport.train.checks import registry as checks
from megaport.train.layouts import registry as layouts


def _run(iterations, losses=None, grad_norms=None, **more):
    return {"iterations": list(iterations), "losses": list(losses or [10.0 - 0.1 * i for i in iterations]),
            "grad_norms": list(grad_norms or [1.0 + 0.01 * i for i in iterations]), **more}


def _directions(upstream_resumed, port_resumed):
    whole = _run(range(1, 31))
    return {cross_load.UPSTREAM_RESUMES: {"uninterrupted": whole, "saved": _run(range(1, 16)),
                                          "resumed": upstream_resumed},
            cross_load.PORT_RESUMES: {"uninterrupted": whole, "saved": _run(range(1, 16)),
                                          "resumed": port_resumed}}


def test_both_directions_resuming_faithfully_hold(tmp_path):
    figures, problems = cross_load.crossed_problems(str(tmp_path), _directions(_run(range(16, 31)),
                                                                                _run(range(16, 31))))
    assert problems == []
    assert set(figures) == set(cross_load.DIRECTIONS)


def test_each_direction_lists_the_shims_its_unported_side_needed(tmp_path):
    """Where unported upstream needed a baseline shim to write or resume (core 0.10-0.12's checkpoint
    writer on today's torch), the report says so, as every baseline run's does."""
    runs = _directions(_run(range(16, 31), baseline_shims=["apex stand-in"]), _run(range(16, 31)))
    runs[cross_load.PORT_RESUMES]["saved"] = _run(range(1, 16), baseline_shims=["apex stand-in", "dcp-write-item"])
    figures, _ = cross_load.crossed_problems(str(tmp_path), runs)
    assert figures[cross_load.UPSTREAM_RESUMES]["baseline_shims"] == ["apex stand-in"]
    assert figures[cross_load.PORT_RESUMES]["baseline_shims"] == ["apex stand-in", "dcp-write-item"]


def test_a_direction_that_trains_nothing_fails_by_name(tmp_path):
    nothing = {"iterations": [], "losses": [], "grad_norms": [], "error": "KeyError: 'step'\n..."}
    _, problems = cross_load.crossed_problems(str(tmp_path), _directions(_run(range(16, 31)), nothing))
    assert problems == ["the port resumes upstream's: the resumed run trained nothing after iteration 15: "
                        "KeyError: 'step'"]


def test_upstream_dropping_the_ports_optimizer_state_fails(tmp_path):
    """A resume whose grad norms leave the uninterrupted run's by 20 % (Adam's moments not restored)."""
    whole = _run(range(1, 31))
    dropped = _run(range(16, 31), whole["losses"][15:], [n * 1.2 for n in whole["grad_norms"][15:]])
    _, problems = cross_load.crossed_problems(str(tmp_path), _directions(dropped, _run(range(16, 31))))
    assert len(problems) == 1 and problems[0].startswith("upstream resumes the port's: per-iteration grad norms")


def test_the_data_iterator_restarted_fails(tmp_path):
    """A resume at the right iteration that reads the first batches again (the data position lost):
    its losses are those of iterations 1 … 15."""
    whole = _run(range(1, 31))
    restarted = _run(range(16, 31), whole["losses"][:15], whole["grad_norms"][15:])
    _, problems = cross_load.crossed_problems(str(tmp_path), _directions(_run(range(16, 31)), restarted))
    assert len(problems) == 1 and problems[0].startswith("the port resumes upstream's: per-iteration losses")


def test_cross_load_is_planned_where_the_resume_is_and_unported_upstream_trains_the_layout():
    assert checks.select("cross-load") == [cross_load.CHECK]
    assert cross_load.not_for(layouts.get("dp2-distopt"), "") is None
    assert "--use-distributed-optimizer or --zero-stage shards" in cross_load.not_for(layouts.get("tp2"), "")
    without_upstream = [layout for layout in layouts.select("all") if not layout.upstream_runs]
    assert without_upstream and all(cross_load.not_for(layout, "") == "unported upstream does not train this layout "
                                    "without TE" for layout in without_upstream)


def test_the_report_row_names_each_direction_on_one_rank_and_in_the_layout():
    whole = _run(range(1, 31))
    same = parity.loss_parity(whole, whole)
    side = {"directions": {name: same for name in cross_load.DIRECTIONS}, "problems": []}
    row = cross_load.figures({"one_rank": side, "layout": side})
    assert row.count("one rank, ") == 2 and row.count("layout, ") == 2
    assert "upstream resumes the port's: loss 0.0e+00" in row


def test_upstream_writing_with_overlapped_param_gather_gets_the_eras_save_fix(tmp_path, monkeypatch):
    """main 2023-11 … 2024-05 wrote a checkpoint one step old with --overlap-param-gather (the ported
    tree resuming it: 20 % in grad norm at its first iteration): the unported side that writes it is
    given upstream's later fix, where its era needs it; the side that resumes is not."""
    from megaport.train import baseline

    started = []
    monkeypatch.setattr(baseline, "run_unported", lambda run, sha, also=(), where_they_apply=():
                        started.append(where_they_apply) or ({}, []))
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "arguments.py").write_text(
        "def add(group):\n    group.add_argument('--overlap-param-gather')\n")
    run = pretrain.Run(tree=str(tmp_path), family="llama", layout="dp2-distopt")
    cross_load._unported(resume._checkpoint_run(run, "/ck", False), "0" * 40)
    cross_load._unported(resume._checkpoint_run(run, "/ck", True), "0" * 40)
    cross_load._unported(resume._checkpoint_run(dataclasses.replace(run, layout="tp2"), "/ck", False), "0" * 40)
    assert started == [("overlap-gather-save",), (), ()]
