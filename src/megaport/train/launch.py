"""What torchrun starts on each rank: the tree's own script as ``__main__``, and its peak memory.

    python -m torch.distributed.run --nproc_per_node 1 ... -m megaport.train.launch [--cpu] pretrain_gpt.py ARGS

``--list-options`` first prints the options of the script's argument parser instead of running it.

With ``--cpu`` the CUDA-only plumbing is substituted first (:mod:`megaport.cpu_substitutions`); a run
whose tokenizer comes from the Hugging Face hub gets its vocabulary in one order
(:mod:`megaport.train.vocab_order`).
When the script returns, one line reports the peak memory: ``torch.cuda.max_memory_allocated()`` on
a GPU (upstream's own memory report comes after the first iteration, before fp16's skipped steps
end and the optimizer's state exists), the process's peak RSS on the CPU. A run given ``--load`` that was asked to train and took no
optimizer step exits 1 with one line (:mod:`megaport.train.resume_guard`), never 0; so does one whose
checkpoint to resume from is truncated, corrupt or missing, before the script runs.
A CPU rank then ends without the interpreter's teardown, having finished what an exit finishes
(:func:`exit_without_teardown`).
"""

from __future__ import annotations

import contextlib
import os
import resource
import runpy
import sys

from megaport.train import failure, resume_guard, vocab_order

PEAK = "> megaport: peak memory"
OPTIONS = "> megaport: parser options"


def _report_options() -> None:
    """With ``--list-options``: the first argument parser the script parses with prints its option
    strings on one line and the run stops there (the era's parser, built after the imports;
    ``--help`` would need every help string to format, which upstream main's does not)."""
    import argparse
    import json

    def parse_known_args(self, args=None, namespace=None):
        print(f"{OPTIONS} {json.dumps(sorted(self._option_string_actions))}", flush=True)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_known_args = parse_known_args


def _peak(torch, cpu: bool) -> str:
    if cpu:
        return f"{PEAK} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024} bytes (process max RSS)"
    return f"{PEAK} {torch.cuda.max_memory_allocated()} bytes (torch.cuda.max_memory_allocated)"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    listing = bool(argv) and argv[0] == "--list-options"
    argv = argv[1:] if listing else argv
    cpu = bool(argv) and argv[0] == "--cpu"
    argv = argv[1:] if cpu else argv
    if not argv or not argv[0].endswith(".py"):
        print("usage: python -m megaport.train.launch [--list-options] [--cpu] SCRIPT.py [ARGS...]", file=sys.stderr)
        return 2
    if cpu and not listing:
        from megaport.train.preloaded import client

        code = client.delegate("rank", argv[1:], script=argv[0])  # a rank forked from the tree's imports, where a server has them
        if code is not None:
            return code
    import torch

    for line in prepare(torch, os.path.dirname(os.path.abspath(argv[0])), cpu):
        print(line, flush=True)
    return run_script(torch, argv[0], argv[1:], cpu, listing=listing)


def prepare(torch, tree: str, cpu: bool) -> list:
    """What a rank sets up before its script's imports (so they see it): the CPU substitutions, whose
    lines it returns, and the vocabulary's order where the run asks. The preloaded server
    (:mod:`megaport.train.preloaded.server`) does the same before its imports."""
    lines = []
    if cpu:
        from megaport import cpu_substitutions

        lines = [f"{cpu_substitutions.MARK} {line}"
                 for line in cpu_substitutions.install(torch, "training", "deepspeed", tree=tree).lines]
    if os.environ.get(vocab_order.ENV):
        vocab_order.install()
    return lines


def run_script(torch, script: str, arguments: list, cpu: bool, *, listing: bool = False) -> int:
    """The script as ``__main__`` with ``arguments``, after :func:`prepare`: its exit code, the
    resume guard's verdict and the peak memory line; a CPU rank then ends here
    (:func:`exit_without_teardown`)."""
    placement = contextlib.nullcontext()
    if cpu:
        from megaport import cpu_substitutions

        placement = cpu_substitutions.install(torch, "placement-mode")  # taken back when the script returns
    if listing:
        _report_options()
    elif problem := resume_guard.checkpoint_problem(arguments):  # never a silent fresh start
        print(problem, file=sys.stderr, flush=True)
        return 1
    steps = resume_guard.count_steps()
    script = os.path.abspath(script)
    sys.argv = [script, *arguments]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        with placement:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # some eras end with sys.exit() after training
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        failure.record(exc)  # what the rank died of, for the baseline's choice of shims
        raise
    if code == 0 and not listing and (error := resume_guard.trained_nothing(arguments, steps)):
        print(error, file=sys.stderr, flush=True)
        code = 1
    if code == 0 and not listing:
        print(_peak(torch, cpu), flush=True)
    _release_process_group(torch)
    if cpu:
        exit_without_teardown(code)
    return code


def _release_process_group(torch) -> None:
    """Destroy the process group the script left (upstream's scripts never do): otherwise its
    threads are torn down with the interpreter, and a loaded machine saw the rank abort at exit
    ("terminate called without an active exception", exit -6) after every iteration had run."""
    dist = torch.distributed
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the run is over; its result is already written
        pass


def exit_without_teardown(code: int) -> None:
    """End a CPU rank as the interpreter would, less its teardown: the rank's non-daemon threads
    are joined and its ``atexit`` functions run (multiprocessing's join of its children, upstream's
    loggers), then the process exits without freeing module by module what the OS takes back at
    once. Measured on main's Llama TP2 (30 iterations): from the last line a rank prints to
    torchrun's exit 2.4 s before, 0.8 s after, on an idle 2-core CPU, of a 21 s run, and a
    default verify starts dozens of runs. Not on a GPU, where it was never measured."""
    import atexit
    import logging
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
