"""Rich progress bars for long git commands (fetches), fed by git's own ``--progress`` output.

Git reports progress on stderr as lines ended by ``\\r`` (updates) or ``\\n`` (final)::

    remote: Counting objects: 100% (5/5), done.
    Receiving objects:  45% (4500/10000), 12.34 MiB | 5.67 MiB/s
    Resolving deltas: 100% (3/3), done.

GitPython's :class:`~git.util.RemoteProgress` parses those lines (its ``update`` gets the phase,
counts and message; other lines it keeps as ``error_lines``/``other_lines``); :class:`RichProgress`
draws one bar per phase. :func:`run_git_with_progress` runs the git command
(:func:`megaport.git.stream_git`) and feeds its stderr to it. The store decides *when* to show
progress; this module only knows *how*.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from git.util import RemoteProgress
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
)

from megaport.git import GitError, git_command, stream_git

__all__ = ["RichProgress", "run_git_with_progress"]


class RichProgress(RemoteProgress):
    """GitPython's progress parser drawing on a rich :class:`~rich.progress.Progress`."""

    PHASES = {
        RemoteProgress.COUNTING: "counting objects",
        RemoteProgress.COMPRESSING: "compressing objects",
        RemoteProgress.WRITING: "writing objects",
        RemoteProgress.RECEIVING: "receiving objects",
        RemoteProgress.RESOLVING: "resolving deltas",
        RemoteProgress.FINDING_SOURCES: "finding sources",
        RemoteProgress.CHECKING_OUT: "checking out files",
    }

    def __init__(self, bar: Progress, description: str) -> None:
        super().__init__()
        self.bar = bar
        self.description = description
        self.tasks: dict[int, TaskID] = {}

    def update(self, op_code, cur_count, max_count=None, message="") -> None:
        stage = op_code & self.OP_MASK
        total = int(max_count) if max_count else None
        task = self.tasks.get(stage)
        if task is None:
            name = self.PHASES.get(stage, "working")
            task = self.tasks[stage] = self.bar.add_task(f"{self.description}: {name}", total=total, detail="")
        done = bool(op_code & self.END) and total is not None
        self.bar.update(task, completed=total if done else int(cur_count), total=total,
                        detail=(message or "").strip(", "))

    def messages(self) -> str:
        """What git said besides progress: the text of an error message."""
        return "\n".join([*self.other_lines, *self.error_lines])


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
    console = console or Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        progress = RichProgress(bar, description)
        returncode, stdout = stream_git(args, cwd, progress.new_message_handler(), env=env)
    stderr = progress.messages()
    if check and returncode != 0:
        raise GitError.from_result(list(args), returncode, stderr)
    return subprocess.CompletedProcess(git_command(args), returncode, stdout, stderr)
