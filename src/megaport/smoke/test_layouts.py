"""Parallel layouts: every layout the tree's era has trains through upstream's own entry point on
several ranks (and two "nodes") and matches one rank from the same checkpoint; where unported
upstream trains the layout without TE, it also matches upstream in that layout.

The runs are the plan of :mod:`megaport.train.plan` (family x layout x check), one test each;
``megaport verify --layouts`` and ``--model`` choose them. A layout the era lacks (no
``--context-parallel-size`` before core 0.6, a model without experts for EP) is not a test: it is
listed in the report with why. Facts: ``layouts.<family>.<layout>.<check>``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

import pytest

from megaport.smoke import _session
from megaport.train import plan as planner
from megaport.train.checks import registry as checks
from megaport.train.checks.spec import Context
from megaport.train.layouts import registry as layouts

_WORKDIR: list = []


def pytest_generate_tests(metafunc):
    if "planned" in metafunc.fixturenames:
        config = metafunc.config
        smoke = config.stash[_session.SMOKE_KEY]
        models = config.getoption("--megaport-models")
        runs, absent = planner.plan(str(smoke.tree), layouts.select(config.getoption("--megaport-layouts")),
                                    checks.select(config.getoption("--megaport-checks")),
                                    models=[m.strip() for m in models.split(",")] if models else None)
        runs, off_gpu = _on_the_cpu_where_they_can(smoke, runs)
        smoke.facts["layouts_absent"] = [f"{a.family} in {a.layout}: {a.why}" for a in absent if not a.check] + off_gpu
        smoke.facts["checks_not_for"] = [f"{a.check} for {a.family} in {a.layout}: {a.why}" for a in absent if a.check]
        if not runs:  # an empty parameter set would be a skip: deselected instead (conftest)
            metafunc.parametrize("planned", [pytest.param(None, marks=pytest.mark.no_layout_runs)], ids=["none"])
            return
        metafunc.parametrize("planned", runs, ids=[r.id for r in runs])


@pytest.fixture(scope="module")
def context(smoke):
    folder = tempfile.mkdtemp(prefix="megaport-layouts-")
    yield Context(str(smoke.tree), smoke.state.get("upstream_sha"), smoke.gpu, smoke.subprocess_env(), folder)
    shutil.rmtree(folder, ignore_errors=True)


def _where(smoke, layout) -> tuple:
    """(on GPUs, why not): GPUs where the machine has one for each rank of the layout, else the CPU.
    Several "nodes" on one machine run on the CPU: each node's rank 0 would take the same GPU."""
    if not smoke.gpu:
        return False, ""
    import torch

    have = torch.cuda.device_count()
    if layout.ranks.nodes > 1:
        return False, "several nodes on one machine run on the CPU (each node's first rank would take GPU 0)"
    if have < layout.ranks.world:
        return False, f"the machine has {have} GPU(s), the layout needs {layout.ranks.world}: on the CPU"
    return True, ""


def _on_the_cpu_where_they_can(smoke, runs) -> tuple:
    """The runs that can train where :func:`_where` puts them, and one line for each that cannot:
    a GPU-only layout without enough GPUs is listed, never a test that skips."""
    kept, listed = [], []
    for run in runs:
        gpu, why = _where(smoke, run.layout)
        if run.layout.gpu_only and not gpu:
            listed.append(f"{run.family.name} in {run.layout.name} vs {run.check.name}: GPUs only "
                          f"({run.layout.gpu_only}); {why or 'no GPU here'}")
        else:
            kept.append(run)
    return kept, listed


def test_layout_trains_and_matches(smoke, context, planned):
    facts = smoke.facts.setdefault("layouts", {}).setdefault(planned.family.name, {}).setdefault(
        planned.layout.name, {})
    gpu, why = _where(smoke, planned.layout)
    if why:
        facts["device"] = why
    try:
        compared = planned.check.compare(dataclasses.replace(context, gpu=gpu), planned.family.name,
                                         planned.layout)
    except RuntimeError as exc:
        facts[planned.check.name] = {"error": str(exc).splitlines()[0]}
        pytest.fail(str(exc), pytrace=False)
    facts[planned.check.name] = compared
    assert not compared["problems"], f"{planned.layout.name} against {compared['against']}:\n" + "\n".join(
        compared["problems"])
