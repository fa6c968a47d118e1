"""What a rank's process and the preloaded server say to each other over a Unix socket (torch-free:
the rank's own process must start in milliseconds).

A request is the process's stdin, stdout and stderr (passed as file descriptors) and one JSON
message: what to run (``kind``: a ``rank``, the script and its arguments; or torchrun's
``launcher``, its arguments), the environment and working folder. The answers are JSON messages: ``{"pid": N}`` (the
child runs), then ``{"exit": code}`` (negative: killed by that signal); or ``{"refused": why}``.
"""

from __future__ import annotations

import json
import socket
import struct

#: set in a run's environment to the server's socket; "0" in the verifying process turns forking off
ENV = "MEGAPORT_PRELOADED_RANKS"
#: where the line each rank (and torchrun) prints about its start begins
MARK = "> megaport: started:"
#: the environment that differs from rank to rank and run to run without changing what the imports
#: did: torchrun's rank variables, megaport's per-run folders. Everything else must be equal.
PER_RUN = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "MEGAPORT_FAILURE_DIR", "MEGAPORT_BASELINE_AUDIT_DIR", ENV})
PER_RUN_PREFIXES = ("TORCHELASTIC_",)
_LENGTH = struct.Struct("!Q")


def per_run(name: str) -> bool:
    return name in PER_RUN or name.startswith(PER_RUN_PREFIXES)


def imports_environment(env) -> dict:
    """The part of ``env`` the imports may have read: all of it but :data:`PER_RUN`."""
    return {k: v for k, v in env.items() if not per_run(k)}


def send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive(sock: socket.socket) -> dict | None:
    """The next message, or None where the other side closed the connection."""
    head = _exactly(sock, _LENGTH.size)
    if head is None:
        return None
    body = _exactly(sock, _LENGTH.unpack(head)[0])
    return None if body is None else json.loads(body)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
