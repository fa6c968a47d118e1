"""torchrun, forked from the preloaded server where one runs for the run's tree (it then skips
importing torch: 1.7 s of CPU a run, on the critical path once the ranks no longer import):

    python -m megaport.train.preloaded.launcher TORCHRUN_ARGS...

is ``python -m torch.distributed.run TORCHRUN_ARGS...``, the same code with the same arguments,
in a fresh interpreter where the server refuses or none runs."""

from __future__ import annotations

import runpy
import sys

from megaport.train.preloaded import client

TORCHRUN = "torch.distributed.run"


def main(argv=None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    code = client.delegate("launcher", arguments)
    if code is not None:
        return code
    sys.argv = [TORCHRUN, *arguments]
    runpy.run_module(TORCHRUN, run_name="__main__", alter_sys=True)
    return 0


def forked_argv(argv: list) -> list:
    """``argv`` (``python -m torch.distributed.run ...``) started through this module instead."""
    at = argv.index(TORCHRUN)
    return [*argv[:at], __name__, *argv[at + 1:]]


if __name__ == "__main__":
    sys.exit(main())
