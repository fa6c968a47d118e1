"""The verifying process's preloaded servers: one per (tree's entry point, environment), started at
a CPU run's first need, at most :data:`KEPT` alive (the least recently used goes: each holds about
0.7 GB), all stopped when this process ends (and each ends by itself if this process dies)."""

from __future__ import annotations

import atexit
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

from megaport.train.preloaded import protocol

#: servers kept at once: a verify goes family by family, and each family's ported and unported
#: runs need one each
KEPT = 3
_STARTED: "collections.OrderedDict[tuple, _Server]" = collections.OrderedDict()


class _Server:
    def __init__(self, script: str, env: dict, python: str):
        self.folder = tempfile.mkdtemp(prefix="megaport-ranks-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "server.log"), "wb")  # noqa: SIM115 - the server's lifetime
        self.proc = subprocess.Popen([python, "-m", "megaport.train.preloaded.server", self.path, script,
                                      "--owner", str(os.getpid())], cwd=os.path.dirname(script), env=env,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def ready(self, timeout: float = 60) -> bool:
        """Its socket is bound (before its imports: a rank that connects now waits for them)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if os.path.exists(self.path):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def serving(self) -> bool:
        """Alive, socket in place (a server whose imports went stale drops its socket at once)."""
        return self.proc.poll() is None and os.path.exists(self.path)

    def stop(self) -> None:
        """SIGTERM: it takes no more ranks and ends when its running ones have."""
        if self.proc.poll() is None:
            self.proc.terminate()
        self.log.close()


def enabled(env: dict) -> bool:
    """Not turned off (``$MEGAPORT_PRELOADED_RANKS=0``) in this process nor in the run's environment."""
    return "0" not in (os.environ.get(protocol.ENV), env.get(protocol.ENV))


def environment_for(script: str, env: dict, python: str | None = None) -> dict:
    """What to add to a CPU run's environment ``env`` so its ranks fork from a server that has
    imported ``script``'s imports in that environment: ``{ENV: socket}``, or {} when turned off
    or no server could start (the ranks then start fresh, as without one)."""
    if not enabled(env):
        return {}
    python = python or sys.executable
    key = (python, os.path.abspath(script), json.dumps(protocol.imports_environment(env), sort_keys=True))
    server = _STARTED.get(key)
    if server is not None and server.serving():
        _STARTED.move_to_end(key)
        return {protocol.ENV: server.path}
    if server is not None:
        _STARTED.pop(key).stop()
    while len(_STARTED) >= KEPT:
        _STARTED.popitem(last=False)[1].stop()
    server = _Server(os.path.abspath(script), {k: v for k, v in env.items() if k != protocol.ENV}, python)
    if not server.ready():
        server.stop()
        return {}
    _STARTED[key] = server
    return {protocol.ENV: server.path}


def stop_all() -> None:
    while _STARTED:
        _STARTED.popitem()[1].stop()


atexit.register(stop_all)
