"""No lock-in, both ways: unported upstream resumes the ported tree's checkpoint, and the ported
tree resumes unported upstream's: what a user moving between an NVIDIA box and a ROCm one needs.

The ported side is the resume check's (:mod:`megaport.train.checks.resume`): one run trains to
iteration 15, saves weights, optimizer, RNG and data position in the era's default format and exits,
beside the uninterrupted 30-iteration run. Here unported upstream (fusions off, the baseline's
shims only where it cannot start without them) resumes that checkpoint to 30; and unported
upstream trains to 15 and saves, and the ported tree resumes that. Unported upstream runs as on an
NVIDIA box, with apex (the baseline's stand-in, :data:`NVIDIA_BOX`), whose fused Adam keeps its step
in the param groups where torch's Adam keeps it per parameter: the port's torch Adam writes and reads
both (before it did, main 2026-08's Llama resumed on an NVIDIA box restarted Adam's bias correction,
5.4 % in loss), and without apex or TE upstream's distributed optimizer resumes no checkpoint, not
even its own.

Each joined run (saved half, then resumed half) is held to the ported uninterrupted run with loss
parity's tolerances (loss 1 %, grad norm 5 %): the two trees differ by their kernels' rounding, so
the resume is compared as the trees are, not bit for bit; a resume that trains nothing, or not
from the saved iteration, fails.
Planned where the resume check is (the distributed optimizer's shards: Llama's ``dp2-distopt``),
on one rank and in the layout; other families on request (``--model gpt,mixtral --layouts
dp2-distopt --checks cross-load``), so a default verify does not repeat one rank's figures on
every layout's row.
"""

from __future__ import annotations

import dataclasses
import os

from megaport.train import baseline, pretrain
from megaport.train.checks import one_rank, resume
from megaport.train.checks.spec import Check, Context, loss_figures
from megaport.train.layouts import registry as layouts

#: the two directions, as the report names them
UPSTREAM_RESUMES, PORT_RESUMES = "upstream resumes the port's", "the port resumes upstream's"
DIRECTIONS = (UPSTREAM_RESUMES, PORT_RESUMES)


#: the machine a checkpoint moves from or to: an NVIDIA box has apex (and TE), and the baseline's
#: apex stand-in gives unported upstream its fused Adam (the step in the param groups); without apex
#: or TE upstream's distributed optimizer cannot even resume its own checkpoint (``assert len(steps)
#: == 1`` on main 2026-08, ``KeyError: 'step'`` in 2024)
NVIDIA_BOX = ("apex",)


#: what the NVIDIA box's upstream is given where it writes the checkpoint another side resumes, in the
#: eras that need it (each shim's ``applies``): upstream's own fix of a checkpoint written one step old
#: with ``--overlap-param-gather`` (2023-11 … 2024-05), which a real box of that window lacks too: the
#: port's side is held to the uninterrupted run, not to upstream's bug
WRITING = ("overlap-gather-save",)


def _unported(run: pretrain.Run, sha: str) -> dict:
    writes = WRITING if (baseline.gives(run, "--save")
                         and "--overlap-param-gather" in layouts.get(run.layout).flags_for(run.tree)) else ()
    result, _ = baseline.run_unported(run, sha, also=NVIDIA_BOX, where_they_apply=writes)
    return result


def _resumed(context: Context, run: pretrain.Run, folder: str, by: str) -> dict:
    """``run`` resuming ``folder``'s checkpoint in the ported tree or unported upstream (``by``);
    a resume that dies is a run that logged nothing, its error kept."""
    resuming = resume._checkpoint_run(run, folder, True)
    try:
        if by == "ported":
            return pretrain.run_pretrain(resuming, context.env)
        return _unported(resuming, context.upstream_sha)
    except RuntimeError as exc:
        return resume.failed_resume(exc)


def _crossed_runs(context: Context, family: str, layout) -> dict:
    """Both directions' saved and resumed runs beside the ported uninterrupted one, made once a session."""
    ported = resume._resumed_runs(context, family, layout)
    base = dataclasses.replace(one_rank.base_run(context, family, layout), layout=layout.name)
    fusions_off = dataclasses.replace(one_rank.base_run(context, family, layout, "fusions-off"), layout=layout.name)

    def make() -> dict:
        folder = os.path.join(context.workdir, f"cross-{family}-{layout.name}-{one_rank.shared_count()}")
        upstream_saved = _unported(resume._checkpoint_run(fusions_off, folder, False), context.upstream_sha)
        return {
            UPSTREAM_RESUMES: {"uninterrupted": ported["uninterrupted"], "saved": ported["saved"],
                               "resumed": _resumed(context, fusions_off, ported["folder"], "unported")},
            PORT_RESUMES: {"uninterrupted": ported["uninterrupted"], "saved": upstream_saved,
                               "resumed": _resumed(context, base, folder, "ported")},
        }
    return one_rank.once(one_rank.key(context, base) + ("cross-load", layout.name), make)


def crossed_problems(tree: str, runs: dict) -> tuple:
    """(figures per direction, problems): each direction's joined run against the uninterrupted one."""
    figures, problems = {}, []
    for name, one in runs.items():
        compared = resume.joined_against(tree, one)
        compared["resumed_iterations"] = one["resumed"]["iterations"]
        # the unported side's shims (its saved half or its resumed half), listed as every baseline's are
        compared["baseline_shims"] = [s for part in ("saved", "resumed") for s in one[part].get("baseline_shims", ())]
        figures[name] = compared
        problems += [f"{name}: {p}" for p in resume.resume_problems(one, compared)]
    return figures, problems


def _one(context: Context, family: str, layout) -> dict:
    figures, problems = crossed_problems(context.tree, _crossed_runs(context, family, layout))
    return {"directions": figures, "problems": problems}


def compare(context: Context, family: str, layout) -> dict:
    """Both directions on one rank and in ``layout``."""
    if not context.upstream_sha:
        raise RuntimeError("the tree records no upstream commit (.git/megaport/state.json)")
    on_one_rank, mine = _one(context, family, layouts.ONE_RANK), _one(context, family, layout)
    return {"one_rank": on_one_rank, "layout": mine,
            "problems": [f"one rank: {p}" for p in on_one_rank["problems"]] + mine["problems"],
            "against": "the ported uninterrupted run, each direction's saved half then resumed half"}


def figures(compared: dict) -> str:
    """Each direction's figures, one rank's first."""
    parts = [("one rank", compared["one_rank"]), ("layout", compared["layout"])]
    return "; ".join(f"{where}, {name}: {loss_figures(one)}"
                     for where, side in parts for name, one in side["directions"].items())


def not_for(layout, tree: str) -> str | None:
    """Why the cross-load is not checked in ``layout``: unported upstream cannot train it without TE,
    or its ranks do not shard the optimizer's state (the resume check's rule)."""
    if not layout.upstream_runs:
        return "unported upstream does not train this layout without TE"
    return resume.not_for(layout, tree)


CHECK = Check(name="cross-load", summary="unported upstream resumes the port's checkpoint and the port "
              "upstream's (one rank and the layout; loss 1 %, grad norm 5 %)", compare=compare, not_for=not_for,
              figures=figures)
