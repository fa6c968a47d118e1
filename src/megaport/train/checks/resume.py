"""A resumed run equals the uninterrupted one: what a preempted job needs of its checkpoints.

Upstream's functional tests save at N/2 and resume; here one run of the layout trains to
iteration 15, saves (weights, optimizer, RNG, data position: upstream's own ``--save``, in the
era's default format) and exits (``--exit-interval``); a second run resumes from it (``--load``)
to 30; both against the uninterrupted 30-iteration run in the same layout, same seed, data and
flags: the same iteration numbers, and per iteration the loss and grad norm within the one-rank
check's tolerances (:func:`megaport.train.parity.parity_problems`). A resumed run that logs no
iteration after the checkpoint is an error (its launcher exits 1: :mod:`megaport.train.resume_guard`).

It holds on one rank (once per family and sizes, shared by every layout checked) and in each
layout whose ranks each hold a shard of the optimizer's state (the distributed optimizer), which a
resume must put back rank by rank. An era whose optimizer shards nothing (upstream before its
distributed optimizer, 2022-02) is checked on one rank and in TP2 (:data:`STAND_IN`), so that no
era's verify goes without a resume.
"""

from __future__ import annotations

import dataclasses
import os

from megaport import deepspeed_fork
from megaport.train import example, parity, pretrain, tree_files
from megaport.train.checks import one_rank
from megaport.train.checks.spec import Check, Context, loss_figures
from megaport.train.layouts import registry as layouts

def saved_at(steps: int) -> int:
    """The iteration the first run saves at and exits: half the compared window."""
    return steps // 2


#: flags of a layout whose ranks each hold a shard of the optimizer's state: upstream's distributed
#: optimizer, and in Megatron-DeepSpeed DeepSpeed's ZeRO (its engine writes one optimizer shard per
#: data-parallel rank, ``zero_pp_rank_N_mp_rank_00_optim_states.pt``)
SHARDED_OPTIMIZERS = ("--use-distributed-optimizer", "--zero-stage")
#: the layout whose resume stands for the others where the era has no optimizer that shards its state
#: (2021's trees): TP2, which every era trains, its ranks each writing their own file of the model
#: and optimizer (without it, such an era's verify checked no resume at all, not even one rank's)
STAND_IN = "tp2"
#: upstream logs a run's first iteration without resetting its running loss, so the run's second
#: logged loss is the mean of its first two (main's training_log); a resumed run's too
_FIRST_LOG_KEPT = ("megatron/training/training.py", "should_reset = not is_first_iteration")


#: what an example script may say that keeps a resume from loading, or a save from writing, what a
#: preempted run needs (main's Mixtral script ends ``--no-load-optim --no-load-rng``: it starts from
#: converted weights): each left out of the runs that save and resume, said in their notes
_NOT_RESUMED = tuple((flag, "a resume loads the optimizer, RNG and data position it saved (the example script's "
                            "flag for starting from converted weights)")
                     for flag in ("--no-load-optim", "--no-load-rng", "--finetune", "--no-save-optim", "--no-save-rng"))


def _checkpoint_run(run: pretrain.Run, folder: str, resumed: bool) -> pretrain.Run:
    """``run`` saving at :func:`saved_at` and exiting, or (``resumed``) loading that checkpoint."""
    at = saved_at(run.sizes.steps)
    run = dataclasses.replace(run, left_out=run.left_out + _NOT_RESUMED)
    if resumed:
        added = (("--load", folder), f"resumes from iteration {at}'s checkpoint (optimizer, RNG, data position)")
    else:
        added = (("--save", folder, "--save-interval", str(at), "--exit-interval", str(at)),
                 f"saves at iteration {at} (optimizer and RNG included) and exits")
    return dataclasses.replace(run, extra=run.extra + (added,))


def _resumed_runs(context: Context, family: str, layout) -> dict:
    """The uninterrupted run of ``layout``, the run that saves halfway and the one that resumes: made once a session."""
    base = dataclasses.replace(one_rank.base_run(context, family, layout), layout=layout.name)

    def make() -> dict:
        folder = os.path.join(context.workdir, f"resume-{family}-{layout.name}-{one_rank.shared_count()}")
        runs = {"folder": folder, "uninterrupted": pretrain.run_pretrain(base, context.env),
                "saved": pretrain.run_pretrain(_checkpoint_run(base, folder, False), context.env)}
        try:
            runs["resumed"] = pretrain.run_pretrain(_checkpoint_run(base, folder, True), context.env)
        except RuntimeError as exc:  # a resume that trains nothing is an error, kept with its log's end
            runs["resumed"] = failed_resume(exc)
        return runs
    return one_rank.once(one_rank.key(context, base) + ("resume", layout.name), make)


def failed_resume(exc: Exception) -> dict:
    """A resume that died, as a run that logged nothing, with the error's text kept."""
    return {"iterations": [], "losses": [], "grad_norms": [], "error": str(exc)}


def _expected(tree: str, uninterrupted: dict) -> dict:
    """What the resumed run should log: the uninterrupted run's figures, its loss at the second
    resumed iteration the mean of that and the one before where upstream logs it so."""
    expected = {k: list(uninterrupted[k]) for k in ("iterations", "losses", "grad_norms")}
    second = saved_at(len(expected["iterations"])) + 2
    if tree_files.tree_says(tree, *_FIRST_LOG_KEPT) and second in expected["iterations"]:
        at = expected["iterations"].index(second)
        expected["losses"][at] = (expected["losses"][at - 1] + expected["losses"][at]) / 2
    return expected


def resume_problems(runs: dict, compared: dict) -> list:
    """Why the saved and resumed runs do not make the uninterrupted one, one sentence each."""
    saved, resumed, whole = runs["saved"], runs["resumed"], runs["uninterrupted"]["iterations"]
    at = saved_at(len(whole))
    if not [i for i in resumed["iterations"] if i > at]:
        why = resumed.get("error", "").strip().splitlines()
        return [f"the resumed run trained nothing after iteration {at}" + (f": {why[0]}" if why else "")]
    problems = []
    if saved["iterations"] + resumed["iterations"] != whole:
        problems.append(f"iterations {saved['iterations']} then {resumed['iterations']} after the resume, "
                        f"not the uninterrupted run's {whole}")
    return problems + parity.parity_problems(compared, len(whole), yardstick="the uninterrupted run")


def joined_against(tree: str, runs: dict) -> dict:
    """The saved run then the resumed one, against the uninterrupted run (loss parity's figures)."""
    joined = {k: runs["saved"][k] + runs["resumed"][k] for k in ("iterations", "losses", "grad_norms")}
    return parity.loss_parity(joined, _expected(tree, runs["uninterrupted"]))


def _one(context: Context, family: str, layout) -> dict:
    """``layout``'s resume against its uninterrupted run."""
    runs = _resumed_runs(context, family, layout)
    compared = joined_against(context.tree, runs)
    steps = len(runs["uninterrupted"]["iterations"])
    compared.update(against=f"the uninterrupted {steps}-iteration run, same layout",
                    saved_at=saved_at(steps), resumed_iterations=runs["resumed"]["iterations"],
                    run={k: runs["resumed"][k] for k in ("command", "notes", "port_log") if k in runs["resumed"]})
    compared["problems"] = resume_problems(runs, compared)
    return compared


def compare(context: Context, family: str, layout) -> dict:
    """The resume on one rank and in ``layout``, each against its uninterrupted run."""
    on_one_rank, mine = _one(context, family, layouts.ONE_RANK), _one(context, family, layout)
    mine["one_rank"] = {k: v for k, v in on_one_rank.items() if k != "run"}
    mine["against"] = "the uninterrupted run, in the layout and on one rank"
    mine["problems"] = [f"one rank: {p}" for p in on_one_rank["problems"]] + mine["problems"]
    return mine


def figures(compared: dict) -> str:
    """The layout's figures, then one rank's."""
    return f"{loss_figures(compared)}; one rank {loss_figures(compared['one_rank'])}"


def not_for(layout, tree: str) -> str | None:
    """Why the resume is not checked in ``layout``: it does not shard the optimizer's state with
    upstream's distributed optimizer (one rank's resume, checked beside each layout that does,
    stands for the others), nor is it the era's stand-in where no layout does."""
    if SHARDED_OPTIMIZERS[0] in layout.flags and deepspeed_fork.is_deepspeed_tree(tree):
        return (f"under DeepSpeed's engine the optimizer is DeepSpeed's, not Megatron's distributed one (the fork's "
                f"save asks it for that one's parameter state: AttributeError 'save_parameter_state'); DeepSpeed's "
                f"ZeRO checkpoints are resumed in dp2-zero1")
    if any(flag in layout.flags for flag in SHARDED_OPTIMIZERS) or (layout.name == STAND_IN and shards_nothing(tree)):
        return None
    return (f"resumes are checked where {' or '.join(SHARDED_OPTIMIZERS)} shards the optimizer's state, and on one "
            f"rank beside it (in {STAND_IN} where the era has neither)")


def shards_nothing(tree: str) -> bool:
    """Whether the era's parser (the unported commit's) has none of :data:`SHARDED_OPTIMIZERS`: no
    layout of it would check a resume but :data:`STAND_IN`. A tree without a parser is no era."""
    return bool(example.parser_text(tree)) and not any(example.parser_has(tree, f) for f in SHARDED_OPTIMIZERS)


CHECK = Check(name="resume", summary="saved halfway and resumed = the uninterrupted run "
              "(one rank and the layout; loss 1 %, grad norm 5 %)", compare=compare, not_for=not_for,
              figures=figures)
