"""Nothing lost, through upstream main's own pretrain_gpt.py (MEGAPORT_UPSTREAM_CLONE; skipped
otherwise; run it on the target stack, Python 3.12, as test_train_fullclone.py): a run killed
(SIGKILL) while writing a checkpoint resumes from the one before, because upstream writes the
tracker only once a checkpoint is complete; a truncated checkpoint is refused with one line by
megaport's launcher (megaport.train.resume_guard), never trained afresh. About 1.5 minutes on 2 cores.

And verify's resume check catches the planted faults of tests/support/faults.py's RESUME_FAULTS (the
optimizer's state dropped on resume, the data iterator restarted): about 2.3 minutes each.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import pytest
from support.faults import RESUME_FAULTS, plant
from support.porting import port

from megaport.train import example, parity, pretrain, resume_guard
from megaport.train.checks import resume
from megaport.train.checks.spec import Context
from megaport.train.layouts import registry as layouts

pytestmark = pytest.mark.fullclone
psutil = pytest.importorskip("psutil")


def _killed_while_saving(run: pretrain.Run, shard, workdir) -> None:
    """Start ``run`` and SIGKILL every process of it as soon as ``shard`` (a file of the checkpoint
    being written) appears."""
    cmd = pretrain.command(run, str(workdir))
    proc = subprocess.Popen(cmd.argv, cwd=cmd.cwd, env={**pretrain.environment(run.tree), **cmd.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while proc.poll() is None and not shard.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_one_before(full_clone, tmp_path):
    tree = tmp_path / "tree"
    code, _, output = port(full_clone, "main", tree)
    assert code == 0, output
    folder, workdir = tmp_path / "ckpt", tmp_path / "work"
    workdir.mkdir()
    saving = (("--save", str(folder), "--save-interval", "2"), "saves at iterations 2 and 4")
    # a ~100 MB checkpoint (65536 x 128 embedding, Adam's state): its write lasts long enough to be cut.
    # fp16 starts at parity's loss scale: a checkpoint saved before the optimizer's first step (every
    # step skipped for an overflow) holds no Adam state, and upstream's resume asks for it (KeyError)
    run = pretrain.Run(str(tree), sizes=example.Sizes(hidden=128, steps=4, vocab=65536), extra=(saving,), warmup=0,
                       initial_loss_scale=parity.PARITY_LOSS_SCALE)
    cut = folder / "iter_0000004" / "__0_0.distcp"
    _killed_while_saving(run, cut, workdir)
    assert cut.exists() and not (cut.parent / ".metadata").exists(), "the kill did not land while iteration 4 was written"
    assert (folder / resume_guard.TRACKER).read_text().strip() == "2"
    assert resume_guard.checkpoint_problem(["--load", str(folder)]) is None

    loading = (("--load", str(folder)), "resumes")
    resumed = pretrain.run_pretrain(dataclasses.replace(run, extra=(saving, loading)))
    assert resumed["iterations"] == [3, 4]  # from iteration 2's checkpoint, not afresh
    assert (folder / resume_guard.TRACKER).read_text().strip() == "4"

    cut.write_bytes(cut.read_bytes()[:1000])  # the checkpoint the resumed run completed, truncated
    with pytest.raises(RuntimeError, match=f"{cut} is truncated"):
        pretrain.run_pretrain(dataclasses.replace(run, extra=(saving, loading)))


@pytest.mark.parametrize("fault", sorted(RESUME_FAULTS))
def test_the_resume_check_catches_a_planted_fault(full_clone, tmp_path, fault):
    """verify's resume check (one rank, GPT) fails with the fault planted in the ported tree."""
    tree = tmp_path / "tree"
    code, _, output = port(full_clone, "main", tree)
    assert code == 0, output
    plant(tree, fault)
    (tmp_path / "work").mkdir()
    context = Context(str(tree), None, False, dict(os.environ), str(tmp_path / "work"))
    compared = resume._one(context, "gpt", layouts.ONE_RANK)
    assert compared["problems"], f"the resume check held with the {fault} fault planted ({RESUME_FAULTS[fault].what})"
    # measured on main d98e8a64dd: grad norms 88 % (optimizer) and 61 % (data) apart, losses 3.0 % and 7.8 %
    assert any("grad norms differ" in p for p in compared["problems"]), compared["problems"]
    assert compared["resumed_iterations"][0] == resume.saved_at(30) + 1  # it resumed: only the comparison sees it
