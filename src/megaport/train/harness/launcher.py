"""Start the harness's fresh interpreter (:mod:`megaport.train.harness.worker`) and read its document.

For the training smoke test, the loss-parity test and ``megaport bench --train`` on trees without
``pretrain_gpt.py``: the ported tree as it is (:func:`run_in_subprocess`), and its unported upstream
commit with its fusions off, as a ROCm user without megaport would run it (:func:`upstream_baseline`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from megaport.train import failure
from megaport.train.baseline import unported_upstream, with_fewest_shims
from megaport.train.shims import audit


def run_in_subprocess(tree, mode: str, env: dict | None = None, timeout: float = 900, **sizes) -> dict:
    """Run the harness on ``tree`` in a fresh interpreter: its JSON document, or a RuntimeError
    with the tail of its output."""

    command = [sys.executable, "-m", "megaport.train.harness", "--tree", str(tree), "--mode", mode]
    for name, value in sizes.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = dict(os.environ if env is None else env)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="megaport-harness-") as failures, \
            tempfile.TemporaryDirectory(prefix="megaport-audit-") as audits:
        env.update({failure.FAILURE_DIR_ENV: failures, audit.AUDIT_DIR_ENV: audits})
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir())
        died_of, port_code = failure.read(failures), audit.read(audits)
    documents = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not documents:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise failure.RunFailed(f"training run on {tree} ({mode}) exited {proc.returncode}:\n{tail}", died_of)
    document = json.loads(documents[-1])
    document["log"] = [line for line in proc.stdout.splitlines() if line.startswith("> ROCm port:")]
    document["baseline_port_code"] = port_code
    return document


def upstream_baseline(tree, sha: str, **sizes) -> tuple[dict, list]:
    """Upstream with its fusions off, on the same sizes: (its run, the baseline shims it needed).
    The unported commit is exported next to the tree and run as a ROCm user without megaport
    would (see :mod:`megaport.train.baseline` for the shims)."""
    from megaport.train.shims.registry import describe

    with unported_upstream(tree, sha) as (upstream, env):
        document, shims = with_fewest_shims(
            lambda shimmed: run_in_subprocess(upstream, "fusions-off", env=shimmed, **sizes), env)
    return document, [describe(s) for s in shims]
