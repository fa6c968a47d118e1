"""Upstream's training log, read: losses and ms/iter per iteration, and why a run failed."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_LOSS = re.compile(r"\blm loss:\s*([-+0-9.eE]+|nan|inf)", re.IGNORECASE)
_GRAD_NORM = re.compile(r"\bgrad norm:\s*([-+0-9.eE]+|nan|inf)", re.IGNORECASE)
_SKIPPED = re.compile(r"number of skipped iterations:\s*(\d+)")
PORT_LINE = "> ROCm port:"
# The exception a rank died of, as its traceback's last line says it (torchrun prefixes "[rankN]: ").
_ERROR = re.compile(r"^(?:\[rank\d+\]: )?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b.*)$", re.M)
#: what megaport's own guards say before they stop a rank (resume_guard): the cause, where the
#: log's last error is a peer's closed connection
_GUARD = re.compile(r"^> megaport: error: (.*)$", re.M)


@dataclass
class Iteration:
    """One line of upstream's training log."""

    iteration: int
    loss: float
    ms: float
    grad_norm: float | None = None  # every era logs it beside the loss (with --clip-grad, the default)


def parse_log(text: str) -> list:
    """Every iteration line of upstream's training log (``iteration N/ M | ... elapsed time per
    iteration (ms): T | ... lm loss: L |``) that reports a loss. fp16's loss scaler skips a step
    whose gradients overflow: older eras then print no loss, upstream since 2025 prints
    ``lm loss: 0.000000E+00`` beside ``number of skipped iterations: 1`` (nothing advanced, so the
    average is 0). Both are left out: neither is a loss."""
    found = []
    for line in text.splitlines():
        it, ms, loss = _ITERATION.search(line), _ELAPSED.search(line), _LOSS.search(line)
        if not (it and ms and loss):
            continue
        skipped = _SKIPPED.search(line)
        if skipped and int(skipped.group(1)) > 0 and float(loss.group(1)) == 0.0:
            continue
        norm = _GRAD_NORM.search(line)
        found.append(Iteration(int(it.group(1)), float(loss.group(1)), float(ms.group(1)),
                               float(norm.group(1)) if norm else None))
    return found


def failure_message(returncode: int, stdout: str, stderr: str, logged: int, lines: int = 25,
                    entry_point: str = "pretrain_gpt.py", first_failure=None) -> str:
    """Why the run failed, in the rank's own words: torchrun's exit status is always 1 and its
    ChildFailedError report ends stderr, so the rank's exit code is read from that report and the
    report itself is left out of the quoted tail. ``first_failure``: the exception the first rank
    to fail recorded (:mod:`megaport.train.failure`), which names the cause where the log's last
    error is another rank's "Connection closed by peer"."""
    code = re.search(r"exitcode\s*:\s*(-?\d+)", stderr)
    launcher = stderr.find("Traceback (most recent call last)") if "ChildFailedError" in stderr else -1
    while launcher >= 0 and "torch/distributed" not in stderr[launcher:launcher + 400]:
        launcher = stderr.find("Traceback (most recent call last)", launcher + 1)
    own = stderr[:launcher] if launcher >= 0 else stderr
    tail = "\n".join((stdout.rstrip() + "\n" + own.rstrip()).strip().splitlines()[-lines:])
    status = f"exit code {code.group(1)}" if code else f"exit code {returncode}"
    errors = [m.group(1) for m in _ERROR.finditer(stdout + "\n" + own)]
    guarded = [m.group(1) for m in _GUARD.finditer(stdout + "\n" + own)]
    cause = first_failure or (guarded[0] if guarded else errors[-1] if errors else "")
    reason = f" {str(cause)[:300]}" if cause else ""
    return f"{entry_point} failed ({status}) after {logged} logged iterations:{reason}\n{tail}"


def port_lines(text: str) -> list:
    """The ``> ROCm port:`` lines the port printed: what it served or switched off."""
    return sorted({line.strip() for line in text.splitlines() if line.strip().startswith(PORT_LINE)})
