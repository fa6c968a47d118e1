"""The port's messages: one ``> ROCm port:`` line per distinct message, whichever module says it
(one set for the whole package, so a message said by two modules still prints once)."""

from __future__ import annotations

import os

_SAID = set()


def say_once(message: str) -> None:
    """Print one ``> ROCm port:`` line per distinct message, on rank 0 only."""
    if message in _SAID or os.environ.get("RANK", "0") != "0":
        return
    _SAID.add(message)
    print(f"> ROCm port: {message}", flush=True)
