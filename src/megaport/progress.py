"""Rich progress bars for long git commands (fetches), fed by git's own ``--progress`` output.

Git reports progress on stderr as lines ended by ``\\r`` (updates) or ``\\n`` (final)::

    remote: Counting objects: 100% (5/5), done.
    Receiving objects:  45% (4500/10000), 12.34 MiB | 5.67 MiB/s
    Resolving deltas: 100% (3/3), done.

:func:`run_git_with_progress` runs a git command, turns each such line into a bar (one per
phase) and keeps every other stderr line for the error message. The store decides *when*
to show progress; this module only knows *how*.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
)

from megaport.git import GitError, git_command, git_env

__all__ = ["ProgressLine", "parse_progress_line", "run_git_with_progress"]

_PERCENT = re.compile(
    r"^(?P<remote>remote:\s*)?(?P<phase>[A-Za-z][A-Za-z ]*?):\s+(?P<pct>\d+)%\s+"
    r"\((?P<cur>\d+)/(?P<total>\d+)\)(?:,\s*(?P<detail>.*?))?\s*$"
)
_COUNTER = re.compile(
    r"^(?P<remote>remote:\s*)?(?P<phase>[A-Za-z][A-Za-z ]*?):\s+(?P<cur>\d+)"
    r"(?:,\s*(?P<detail>.*?))?\s*$"
)


@dataclass(frozen=True)
class ProgressLine:
    """One parsed progress line. ``total`` is None for plain counters ("Enumerating
    objects: 1234"); ``detail`` is the rest ("12.34 MiB | 5.67 MiB/s"), without "done."."""

    phase: str
    current: int
    total: int | None
    detail: str = ""
    remote: bool = False
    done: bool = False


def parse_progress_line(line: str) -> ProgressLine | None:
    """Parse one line of ``git fetch --progress`` stderr; None when it is not progress."""
    line = line.strip()
    m = _PERCENT.match(line) or _COUNTER.match(line)
    if m is None:
        return None
    detail = (m.group("detail") or "").strip()
    done = detail == "done." or detail.endswith(", done.")
    if done:
        detail = detail[: -len("done.")].rstrip(", ").strip()
    total = int(m.group("total")) if "total" in m.groupdict() else None
    return ProgressLine(
        phase=m.group("phase").strip(),
        current=int(m.group("cur")),
        total=total,
        detail=detail,
        remote=bool(m.group("remote")),
        done=done,
    )


def run_git_with_progress(
    args: Sequence[str],
    cwd: str | os.PathLike[str] | None = None,
    *,
    description: str = "git",
    env: Mapping[str, str] | None = None,
    check: bool = True,
    console: Console | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``git <args>`` while drawing its progress on ``console`` (stderr by default).

    ``args`` should contain ``--progress`` (git only reports progress to a terminal
    otherwise). Returns a ``CompletedProcess`` whose ``stderr`` holds the non-progress
    lines; raises :class:`~megaport.git.GitError` on failure when ``check`` is true, with
    the same message :func:`megaport.git.run_git` would give.
    """
    argv = git_command(args)
    console = console or Console(stderr=True)
    other: list[str] = []
    out: list[bytes] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def handle(raw: bytes) -> None:
            text = raw.decode("utf-8", "replace")
            info = parse_progress_line(text)
            if info is None:
                if text.strip():
                    other.append(text.rstrip())
                return
            task = tasks.get(info.phase)
            if task is None:
                task = tasks[info.phase] = bar.add_task(
                    f"{description}: {info.phase.lower()}", total=info.total, detail=""
                )
            completed = info.total if info.done and info.total else info.current
            bar.update(task, completed=completed, total=info.total, detail=info.detail)

        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=git_env(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except FileNotFoundError as exc:
            raise GitError("git is not installed or not on PATH; install git and retry") from exc
        assert proc.stdout is not None and proc.stderr is not None
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        pending = b""
        fd = proc.stderr.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = re.split(rb"[\r\n]", pending + chunk)
            for raw in lines:
                handle(raw)
        if pending:
            handle(pending)
        proc.stderr.close()
        returncode = proc.wait()
        reader.join()
    stdout = b"".join(out).decode("utf-8", "surrogateescape")
    stderr = "\n".join(other)
    if check and returncode != 0:
        raise GitError.from_result(list(args), returncode, stderr)
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
