"""Start the 2-rank distributed check early, so its processes import Megatron while the rest of
the suite runs, and collect its results when test_distributed.py asks for them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megaport.train import torchrun

WORKER = Path(__file__).with_name("_dist_worker.py")
RANKS = 2
TIMEOUT = 300


@dataclass
class Launch:
    backend: str
    device_kind: str
    out: Path
    proc: subprocess.Popen
    started: float
    log_path: Path


_LAUNCHES: dict = {}


def worker_command(smoke, backend: str, device_kind: str, out: Path) -> list[str]:
    """The launcher's command line. Whether the era fuses the wgrad GEMM is decided here, from the
    unported upstream commit (megaport.smoke._fork.era_fuses_wgrad), and handed to the ranks."""
    from megaport.smoke._fork import era_fuses_wgrad

    fuses, note = era_fuses_wgrad(smoke.upstream, smoke.tree)
    if not fuses:
        smoke.facts["era_wgrad_fusion"] = note or f"never fuses: {smoke.upstream.label}'s layers call no wgrad GEMM"
    if note:
        unverified = smoke.facts.setdefault("era_unverified", [])
        if note not in unverified:
            unverified.append(note)
    target = [str(WORKER), "--tree", str(smoke.tree), "--out", str(out), "--device", device_kind,
              "--backend", backend, "--wgrad-fusion", "yes" if fuses else "no"]
    return torchrun.node_commands(torchrun.Ranks(RANKS), target)[0]


def start(smoke, backend: str, device_kind: str) -> Launch:
    """The one torchrun launcher (:mod:`megaport.train.torchrun`) with the worker."""
    key = (backend, device_kind)
    if key in _LAUNCHES:
        return _LAUNCHES[key]
    out = Path(tempfile.mkdtemp(prefix="megaport-dist-"))
    command = worker_command(smoke, backend, device_kind, out)
    env = smoke.subprocess_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = out / "launch.log"
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=str(out), start_new_session=True)
    launch = Launch(backend, device_kind, out, proc, time.time(), log_path)
    _LAUNCHES[key] = launch
    return launch


def results(smoke, backend: str, device_kind: str) -> tuple[list[dict] | None, str]:
    """(one dict per rank, "") or (None, why) once the run has ended or timed out."""
    launch = start(smoke, backend, device_kind)
    remaining = TIMEOUT - (time.time() - launch.started)
    try:
        launch.proc.wait(timeout=max(remaining, 1))
    except subprocess.TimeoutExpired:
        stop(launch)
        return None, f"the 2-rank {backend} run did not finish in {TIMEOUT} s (hung collective?)\n{tail(launch)}"
    ranks = []
    for rank in range(RANKS):
        path = launch.out / f"rank{rank}.json"
        if not path.is_file():
            return None, f"rank {rank} of the 2-rank {backend} run wrote no result (exit {launch.proc.returncode})\n{tail(launch)}"
        ranks.append(json.loads(path.read_text(encoding="utf-8")))
    return ranks, ""


def tail(launch: Launch, lines: int = 40) -> str:
    try:
        text = launch.log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def stop(launch: Launch) -> None:
    if launch.proc.poll() is None:
        try:
            os.killpg(launch.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        launch.proc.wait()


def stop_all() -> None:
    for launch in _LAUNCHES.values():
        stop(launch)
        shutil.rmtree(launch.out, ignore_errors=True)
    _LAUNCHES.clear()
