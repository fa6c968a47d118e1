"""The one torchrun launcher: every multi-process run megaport starts (a training run on one or
more "nodes", the smoke suite's 2-rank check) is ``python -m torch.distributed.run`` built here.

On one machine a rendezvous on 127.0.0.1 with a free port; a run of several "nodes" is one
launcher per node, all with the same ``--nnodes``, ``--master_addr 127.0.0.1`` and port, each
with its ``--node_rank`` (what two ROCm nodes run, with the first node's address in place of the
loopback one). Nothing here reaches beyond loopback.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Ranks:
    """How a run is spread: processes per node and nodes."""

    per_node: int = 1
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.per_node * self.nodes


def free_port() -> int:
    """A TCP port free on the loopback address now (the rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def launcher_argv(ranks: Ranks, *, port: int, node_rank: int = 0, python: str | None = None) -> list:
    """torchrun's own part of the command line for one node of ``ranks``; the target follows."""
    argv = [python or sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks.per_node)]
    if ranks.nodes > 1:
        argv += ["--nnodes", str(ranks.nodes), "--node_rank", str(node_rank)]
    return argv + ["--master_addr", LOOPBACK, "--master_port", str(port)]


def node_commands(ranks: Ranks, target: list, *, port: int | None = None, python: str | None = None) -> list:
    """One command per node, each torchrun's flags then ``target`` (``-m module args`` or a script
    and its args); the nodes share one rendezvous port."""
    port = port or free_port()
    return [launcher_argv(ranks, port=port, node_rank=n, python=python) + list(target) for n in range(ranks.nodes)]
