"""The process torchrun starts for a rank (or the one that would be torchrun) when a preloaded server
runs for its tree: it hands the work to the server and stands in for the forked child towards its
own parent (signals in, exit code out). Torch-free."""

from __future__ import annotations

import os
import signal
import socket
import sys

from megaport.train.preloaded import protocol

#: how each kind of process is named in its start line
_NAMES = {"rank": "rank", "launcher": "torchrun"}
#: what torchrun (or a user's Ctrl-C) may send the rank: passed on to the child that is the rank
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def delegate(kind: str, arguments: list, script: str = "") -> int | None:
    """Run a ``rank`` of ``script`` (or torchrun's ``launcher``) with ``arguments`` in a child of
    the server ``$MEGAPORT_PRELOADED_RANKS`` names: its exit code, or None (one line printed) where
    there is no server or it refused: the caller then starts it itself."""
    path = os.environ.get(protocol.ENV)
    if not path or path == "0":
        return None
    # held back until the child's pid is known, then passed on to it (not lost, nor fatal to this
    # process while the child runs on)
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socket.send_fds(sock, [b"F"], [0, 1, 2])
        protocol.send(sock, {"kind": kind, "script": os.path.abspath(script) if script else "",
                             "arguments": list(arguments), "cwd": os.getcwd(), "env": dict(os.environ)})
        answer = protocol.receive(sock)
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        print(f"{protocol.MARK} {_NAMES[kind]}: fresh interpreter (the preloaded server at {path} did not answer: "
              f"{exc})", flush=True)
        return None
    if answer is None or "pid" not in answer:
        sock.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        why = "it closed the connection" if answer is None else answer.get("refused", answer)
        print(f"{protocol.MARK} {_NAMES[kind]}: fresh interpreter (the preloaded server refused: {why})", flush=True)
        return None
    return _stand_in(sock, answer["pid"])


def _stand_in(sock: socket.socket, pid: int) -> int:
    """Until the child ends: signals sent to this process go to it; then its exit code, or this
    process ends by the signal that ended the child, as the rank itself would have."""
    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    answer = protocol.receive(sock)
    sock.close()
    if answer is None or "exit" not in answer:
        print(f"{protocol.MARK} the preloaded server ended before rank process {pid} did", file=sys.stderr, flush=True)
        return 1
    code = answer["exit"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
