"""Training smoke: every model family the tree has trains through upstream's own entry point for
it, with the same loss per iteration as the unported upstream commit with its fusions off.

The families (:mod:`megaport.train.families`) are the tests' parameters: GPT's ``pretrain_gpt.py``
with its era's gpt3 example, BERT's and T5's scripts (the padding-mask softmax), Llama, Mixtral and
DeepSeek through ``pretrain_gpt.py`` with their own flags; ``megaport verify --model`` picks some.
GPT's facts keep their keys (``training``, ``loss_parity``); every family's are under
``families.<name>`` as well.

A Megatron-LM tree runs its own ``pretrain_gpt.py`` with the flags of its era's example script,
changed in size, iterations and data only (:mod:`megaport.train.pretrain`): upstream's model
provider, forward step, training loop, optimizer, LR scheduler and fp16/bf16 wrapper, under
torchrun, on the GPU, or on the CPU with the substitutions for CUDA-only plumbing listed in the
report. A tree made from PyPI's megatron-core has no ``pretrain_gpt.py``; it trains through
upstream's megatron.core builders in-process (:mod:`megaport.train.harness`).

The yardstick is the tree's unported upstream commit, exported next to it (the tree is not
touched), run the same way with its fusions off; shims it needed to start on this stack are
listed (:mod:`megaport.train.shims`), none of them the port's code, which every baseline process
proves. Never the port against itself.

Parity compares what a broken port changes: the loss *and* the grad norm upstream logs, per
iteration, over a window in which the model measurably learns (the loss falls by 10 % at least;
the run's learning rate is raised for it where the example's is too small for a short run, and
the report says so: :mod:`megaport.train.parity`). A fault in the optimizer step, the clipping
or the grad norm then moves one of them by far more than the tolerance.
"""

from __future__ import annotations

import statistics
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from megaport.smoke import _locate, _session, _verdicts
from megaport.train import baseline, parity, pretrain
from megaport.train.harness import launcher
from megaport.train.families import registry

MIN_LOGGED = parity.MIN_COMPARED  # iterations with a loss (fp16's loss-scale search skips the first ~16)
HARNESS_STEPS = 48


def pytest_generate_tests(metafunc):
    """One test of each kind per family: those ``--megaport-models`` names, else all the tree has."""
    if "family" in metafunc.fixturenames:
        smoke = metafunc.config.stash[_session.SMOKE_KEY]
        names = metafunc.config.getoption("--megaport-models")
        chosen = [f.name for f in registry.select(str(smoke.tree), names)]
        metafunc.parametrize("family", chosen, ids=chosen, scope="module")


def _entry_point(smoke, family: str) -> str:
    spec = registry.get(family)
    if spec.has_entry_point(str(smoke.tree)):
        return spec.entry_point
    if spec.harness:
        return "harness"  # PyPI's megatron-core: no pretrain_gpt.py, upstream's builders in-process
    raise RuntimeError(f"the tree has no {spec.entry_point}")


def _pretrain_run(smoke, family: str, mode: str = "ported") -> pretrain.Run:
    return parity.parity_run(str(smoke.tree), mode, gpu=smoke.gpu, family=family)


def _harness(smoke, tree, mode, env):
    return launcher.run_in_subprocess(tree, mode, env=env, steps=HARNESS_STEPS, device="cuda" if smoke.gpu else "cpu")


def _facts(smoke, family: str) -> dict:
    return smoke.facts.setdefault("families", {}).setdefault(family, {})


#: each family's unported run, started beside its ported run: two processes on two trees, which
#: share nothing; a short CPU run is mostly one thread's Python, so on 2 cores the pair takes little
#: longer than one (main's Llama, loaded machine: 48 s + 30 s of waiting, against 63 s + 114 s one
#: after the other in the last session's matrix)
_BASELINES: dict = {}
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megaport-baseline")


def _baseline(smoke, family: str) -> Future:
    """The family's unported run (:func:`baseline.run_unported`), started once."""
    key = (str(smoke.tree), family)
    if key not in _BASELINES:
        _BASELINES[key] = _POOL.submit(baseline.run_unported, _pretrain_run(smoke, family, "fusions-off"),
                                       smoke.state.get("upstream_sha"))
    return _BASELINES[key]


def _skip_without_what_the_model_needs(spec, facts: dict) -> None:
    """A family whose model is a third-party package's (:attr:`Family.needs`) skips where that
    package is not installed, with the suite's one line for a missing upstream dependency."""
    for package in spec.missing_packages():
        _, why = _verdicts.missing_import_verdict(package)
        facts["error"] = f"{why} (the {spec.name} family's layers come from it)"
        pytest.skip(facts["error"])


@pytest.fixture(scope="module")
def ported_run(smoke, family):
    facts = _facts(smoke, family)
    spec = registry.get(family)
    facts["entry_point"] = spec.entry_point
    facts["flags_from"] = spec.flags(str(smoke.tree))[1]  # said even where the run fails
    _skip_without_what_the_model_needs(spec, facts)
    try:
        entry = _entry_point(smoke, family)
        facts["entry_point"] = entry
        if entry != "harness":
            if smoke.state.get("upstream_sha"):
                _baseline(smoke, family)
            document = pretrain.run_pretrain(_pretrain_run(smoke, family), smoke.subprocess_env())
        else:
            document = _harness(smoke, smoke.tree, "ported", smoke.subprocess_env())
    except RuntimeError as exc:
        facts["error"] = str(exc).splitlines()[0]
        pytest.fail(str(exc), pytrace=False)
    document["entry_point"] = entry
    keep = ("entry_point", "command", "data", "notes", "ms_per_iter", "tokens_per_s", "peak_memory_bytes",
            "peak_memory_kind", "port_log", "substitutions", "layer_spec", "fusions", "fusions_after_config", "ddp",
            "optimizer", "upstream_parser", "transformer_impl_default", "log", "engine", "started")
    training = {k: document[k] for k in keep if k in document}
    losses = [round(v, 4) for v in document["losses"]]
    facts.update(training=training, training_losses=losses, iterations=len(losses))
    if spec.headline:  # the top-level keys, as before families
        smoke.facts["training"] = training
        smoke.facts["training_losses"] = losses
        if any(v is not None for v in document.get("grad_norms") or ()):
            smoke.facts["training_grad_norms"] = document["grad_norms"]
        if document.get("substitutions"):
            smoke.facts["training_cpu_substitutions"] = document["substitutions"]
    return document


def test_trains_through_upstreams_entry_point_with_the_example_flags(smoke, family, ported_run):
    losses = ported_run["losses"]
    assert len(losses) >= MIN_LOGGED, f"upstream logged a loss for {len(losses)} iterations; need {MIN_LOGGED}"
    assert all(v == v for v in losses), f"loss became NaN: {losses}"
    window = max(1, min(10, len(losses) // 4))  # the harness logs a dozen steps
    first, last = statistics.mean(losses[:window]), statistics.mean(losses[-window:])
    assert last < first, (f"loss did not fall (mean of the first {window} {first:.4f}, of the last {window} "
                          f"{last:.4f}): {[round(v, 3) for v in losses]}")
    if ported_run["entry_point"] == "harness":
        assert _locate.is_under_path(Path(ported_run["megatron_core"]), smoke.tree), (
            f"the run imported megatron.core from {ported_run['megatron_core']}, not from the tree")
        assert ported_run["fusions_after_config"].get("masked_softmax_fusion", True), \
            "masked_softmax_fusion was switched off: the port's softmax never ran"


def test_loss_matches_unported_upstream_with_fusions_off(smoke, family, ported_run):
    sha = smoke.state.get("upstream_sha")
    if not sha:
        pytest.fail("the tree records no upstream commit (.git/megaport/state.json)", pytrace=False)
    try:
        if ported_run["entry_point"] != "harness":
            base, _ = _baseline(smoke, family).result()
            shims = base["baseline_shims"]
            compared = parity.loss_parity(ported_run, base)
        else:
            base, shims = launcher.upstream_baseline(smoke.tree, sha, steps=HARNESS_STEPS,
                                                     device="cuda" if smoke.gpu else "cpu")
            steps = list(range(1, HARNESS_STEPS + 1))  # the harness logs every step
            compared = parity.loss_parity(dict(ported_run, iterations=steps), dict(base, iterations=steps))
    except RuntimeError as exc:
        _facts(smoke, family)["parity_error"] = str(exc).splitlines()[0]
        pytest.fail(str(exc), pytrace=False)
    compared.update(against="unported upstream, fusions off", baseline_shims=shims)
    _facts(smoke, family)["loss_parity"] = compared
    if registry.get(family).headline:
        smoke.facts["loss_parity"] = compared
    problems = parity.parity_problems(compared, min(len(ported_run["losses"]), len(base["losses"])))
    compared["problems"] = problems
    assert not problems, "\n".join(problems)
