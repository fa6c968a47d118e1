"""Hugging Face weights in: a tiny model made by ``transformers``, converted by upstream's own
``tools/checkpoint/convert.py`` with its docs' command, loads in the ported tree at TP1 and TP2 with
the loss ``transformers`` computes on the same tokens (:mod:`megaport.train.hf_in`).

A family whose loader the tree lacks (Llama on main since May 2026), or a machine without the
packages the converter imports, is listed in the report with why, never a test that skips.
Facts: ``hf_in.<family>.tp<N>``.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from megaport.smoke import _session
from megaport.train import hf_in

#: the tensor-parallel sizes the converter writes and pretrain_gpt.py loads
TP_SIZES = (1, 2)


def pytest_generate_tests(metafunc):
    if "hf_row" not in metafunc.fixturenames:
        return
    config = metafunc.config
    smoke = config.stash[_session.SMOKE_KEY]
    models = config.getoption("--megaport-models")
    wanted = [m.strip() for m in models.split(",")] if models else list(hf_in.SOURCES)
    rows, absent = [], []
    missing = hf_in.missing_packages() if any(f in hf_in.SOURCES for f in wanted) else []
    for family in (f for f in wanted if f in hf_in.SOURCES):
        why = hf_in.absent(str(smoke.tree), family) or (
            f"the converter imports {', '.join(missing)}, which this Python lacks: pip install {' '.join(missing)}"
            if missing else None)
        if why:
            absent.append(f"{family}: {why}")
        else:
            rows += [(family, tp) for tp in TP_SIZES]
    smoke.facts["hf_in_absent"] = absent
    if not rows:  # an empty parameter set would be a skip: deselected instead (conftest)
        metafunc.parametrize("hf_row", [pytest.param(None, marks=pytest.mark.no_hf_rows)], ids=["none"])
        return
    metafunc.parametrize("hf_row", rows, ids=[f"{family}-tp{tp}" for family, tp in rows])


@pytest.fixture(scope="module")
def workdir():
    folder = tempfile.mkdtemp(prefix="megaport-hf-in-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_hf_weights_convert_and_load_with_transformers_loss(smoke, workdir, hf_row):
    family, tp = hf_row
    facts = smoke.facts.setdefault("hf_in", {}).setdefault(family, {})
    try:
        compared = hf_in.round_trip(str(smoke.tree), family, tp, workdir, smoke.subprocess_env(), gpu=smoke.gpu)
    except RuntimeError as exc:
        facts[f"tp{tp}"] = {"error": str(exc).splitlines()[0]}
        pytest.fail(str(exc), pytrace=False)
    facts[f"tp{tp}"] = compared
    assert not compared["problems"], "\n".join(compared["problems"])
