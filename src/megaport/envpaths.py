"""Folders first on a child process's PYTHONPATH: one helper, so every process megaport starts
(a training rank, the smoke suite, a parser probe, a baseline) puts the tree's code before whatever
the environment already names, the same way."""

from __future__ import annotations

import os


def with_paths_first(env: dict | None, *paths) -> dict:
    """A copy of ``env`` (``os.environ`` when None) with ``paths`` first on PYTHONPATH, in order,
    each once, empty entries dropped."""
    env = dict(os.environ if env is None else env)
    first = [str(p) for p in paths if str(p)]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    return env


def without_pythonpath(env: dict | None = None) -> dict:
    """A copy of ``env`` without PYTHONPATH (a baseline process must not see the ported tree)."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
