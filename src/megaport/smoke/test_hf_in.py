"""Hugging Face weights in: a tiny model made by ``transformers``, converted by upstream's own
``tools/checkpoint/convert.py`` with its docs' command, loads in the ported tree at TP1 and TP2 with
the loss ``transformers`` computes on the same tokens (:mod:`megaport.train.hf_in`); where the
family's docs convert to an expert-parallel size (Mixtral), at EP2 too.

Where upstream removed the family's loader and its docs name Megatron-Bridge (Llama on main since May
2026), the weights come in through Bridge's import. A family the tree cannot bring in, or a machine
without the packages the conversion imports, is listed in the report with why, never a test that skips.
Facts: ``hf_in.<family>.tp<N>`` (``tp<N>-ep<M>`` at an expert-parallel size above 1).
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from megaport.smoke import _session
from megaport.train import hf_in

def pytest_generate_tests(metafunc):
    if "hf_row" not in metafunc.fixturenames:
        return
    config = metafunc.config
    smoke = config.stash[_session.SMOKE_KEY]
    models = config.getoption("--megaport-models")
    wanted = [m.strip() for m in models.split(",")] if models else list(hf_in.SOURCES)
    rows, absent = [], []
    tree = str(smoke.tree)
    for family in (f for f in wanted if f in hf_in.SOURCES):
        bridge = hf_in.through_bridge(tree, family)
        why = hf_in.absent(tree, family)
        missing = [] if why else hf_in.missing_packages(bridge=bridge, env=smoke.subprocess_env())
        if missing:
            why = (f"the {'Megatron-Bridge import' if bridge else 'converter'} needs {', '.join(missing)}, which "
                   f"this Python lacks: pip install {' '.join(missing)}")
        if why:
            absent.append(f"{family}: {why}")
        else:
            rows += [(family, tp, ep) for tp, ep in hf_in.SOURCES[family].layouts]
    smoke.facts["hf_in_absent"] = absent
    if not rows:  # an empty parameter set would be a skip: deselected instead (conftest)
        metafunc.parametrize("hf_row", [pytest.param(None, marks=pytest.mark.no_hf_rows)], ids=["none"])
        return
    metafunc.parametrize("hf_row", rows, ids=[f"{family}-{hf_in.layout_name(tp, ep)}" for family, tp, ep in rows])


@pytest.fixture(scope="module")
def workdir():
    folder = tempfile.mkdtemp(prefix="megaport-hf-in-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_hf_weights_convert_and_load_with_transformers_loss(smoke, workdir, hf_row):
    family, tp, ep = hf_row
    facts = smoke.facts.setdefault("hf_in", {}).setdefault(family, {})
    layout = hf_in.layout_name(tp, ep)
    try:
        compared = hf_in.round_trip(str(smoke.tree), family, tp, workdir, smoke.subprocess_env(), gpu=smoke.gpu,
                                    ep=ep)
    except RuntimeError as exc:
        facts[layout] = {"error": str(exc).splitlines()[0]}
        pytest.fail(str(exc), pytrace=False)
    facts[layout] = compared
    assert not compared["problems"], "\n".join(compared["problems"])
