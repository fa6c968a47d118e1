"""Upstream's own entry point on a GPU: ``torchrun pretrain_gpt.py`` with the era's example flags.

What a ROCm user runs after ``megaport apply`` is upstream's ``pretrain_gpt.py`` with the flags of
upstream's example script. ``megaport verify`` on a GPU does the same (test_pretrain.py), shrunk in
size only, and reports the loss per iteration and ms/iter from upstream's own training log:

    python -m megaport.smoke._pretrain --tree DIR [--layers 2 --hidden 256 ...] [--print-command]

The flags come from the tree's example script (see :mod:`megaport.smoke._example`), with sizes,
parallelism and I/O replaced. Eras whose parser has ``--mock-data`` train on mock data with the
NullTokenizer; older ones get a tiny dataset in upstream's indexed format (``.bin``/``.idx``,
MMIDIDX version 1) and a byte-level GPT-2 vocabulary written here, so nothing is downloaded.

Upstream's training loop needs CUDA (``torch.cuda.set_device``, NCCL, CUDA events), so this runs
only where a GPU is visible; on the CPU the training smoke test runs upstream's own parser and
builders in-process instead (:mod:`megaport.smoke._gpt`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from megaport.smoke import _example as example
from megaport.smoke import _gpt

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_LOSS = re.compile(r"\blm loss:\s*([-+0-9.eE]+)")
_MAX_ALLOCATED = re.compile(r"max allocated:\s*([0-9.]+)")  # upstream's memory report, in MB

# The GPT-2 byte-level alphabet: printable bytes stand for themselves, the others are shifted past
# 255 (the same table as upstream's gpt2_tokenization.bytes_to_unicode).
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
EOD = "<|endoftext|>"
BYTE_VOCAB_SIZE = 257  # the 256 byte symbols and EOD, the last id


@dataclass
class Iteration:
    """One line of upstream's training log."""

    iteration: int
    loss: float
    ms: float


@dataclass
class Command:
    """What runs: argv, working directory, and the files written for it."""

    argv: list
    cwd: str
    data: str
    notes: list = field(default_factory=list)

    def shell(self) -> str:
        return f"cd {shlex.quote(self.cwd)} && " + " ".join(shlex.quote(a) for a in self.argv)


def write_gpt2_vocabulary(directory: str) -> tuple[str, str]:
    """A byte-level GPT-2 vocabulary (256 byte symbols and the end-of-document token) and an
    empty merges list: upstream's GPT2BPETokenizer loads them; paths of vocab.json, merges.txt."""
    shifted = [b for b in range(256) if b not in _PRINTABLE]
    symbols = [chr(b) for b in _PRINTABLE] + [chr(256 + n) for n in range(len(shifted))]
    vocab = {symbol: n for n, symbol in enumerate(symbols)}
    vocab[EOD] = len(vocab)
    assert len(vocab) == BYTE_VOCAB_SIZE
    vocab_file, merges_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return vocab_file, merges_file


def write_indexed_dataset(prefix: str, documents: list) -> None:
    """``prefix.bin``/``prefix.idx`` in upstream's mmap indexed format (MMIDIDX, version 1,
    uint16 tokens): one sequence per document, as upstream's preprocess_data.py writes them."""
    sizes = [len(doc) for doc in documents]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            f.write(struct.pack(f"<{len(doc)}H", *doc))
    pointers, offset = [], 0
    for size in sizes:
        pointers.append(offset)
        offset += 2 * size
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 8))  # uint16 in upstream's dtype codes
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(documents) + 1))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(documents) + 1}q", *range(len(documents) + 1)))


def learnable_documents(count: int, length: int, vocab: int, seed: int) -> list:
    """Runs of consecutive token ids with random starts and strides, ending with the
    end-of-document id ``vocab - 1``: a model learns them within a few steps, so the loss falls."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        start, stride = rng.randrange(vocab - 1), rng.randrange(1, 4)
        docs.append([(start + stride * k) % (vocab - 1) for k in range(length - 1)] + [vocab - 1])
    return docs


def command(tree: str, run: _gpt.Run, workdir: str, *, nproc: int = 1, port: int | None = None) -> Command:
    """The torchrun command of upstream's pretrain_gpt.py for ``run`` (sizes, steps, seed)."""
    tokens, source = example.example_flags(tree)
    notes = [f"flags of {source}, shrunk in size only"]
    if example.parser_has(tree, "--mock-data"):
        data, described = example.mock_data(run), "mock data, NullTokenizer"
    else:
        vocab_file, merges_file = write_gpt2_vocabulary(workdir)
        prefix = os.path.join(workdir, "tiny_text_document")
        tokens_needed = (run.steps + 2) * run.batch * (run.seq + 1)
        write_indexed_dataset(prefix, learnable_documents(max(64, 2 * tokens_needed // (4 * run.seq)),
                                                          4 * run.seq, BYTE_VOCAB_SIZE, run.seed))
        data = ["--data-path", prefix, "--vocab-file", vocab_file, "--merge-file", merges_file,
                "--tokenizer-type", "GPT2BPETokenizer", *example.SHORT_RUN]
        described = "a tiny indexed dataset and byte-level GPT-2 vocabulary written for the run"
        notes.append(f"the tree's parser has no --mock-data: {described}")
    flags = example.shrunk(tokens, run, data=data)
    if run.mode == "fusions-off":
        flags += example.FUSIONS_OFF_FLAGS
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(port or _free_port())]
    return Command(launcher + ["pretrain_gpt.py", *flags], tree, described, notes)


def parse_log(text: str) -> list:
    """Every iteration line of upstream's training log (``iteration N/ M | ... elapsed time per
    iteration (ms): T | ... lm loss: L |``); lines without a loss (skipped fp16 steps) are left out."""
    found = []
    for line in text.splitlines():
        it, ms, loss = _ITERATION.search(line), _ELAPSED.search(line), _LOSS.search(line)
        if it and ms and loss:
            found.append(Iteration(int(it.group(1)), float(loss.group(1)), float(ms.group(1))))
    return found


def run_pretrain(tree: str, run: _gpt.Run, env: dict | None = None, *, timeout: float = 1800) -> dict:
    """Run upstream's pretrain_gpt.py for ``run`` and read its log: losses, ms/iter (median after
    ``run.warmup``), the command. Raises RuntimeError with the log's end when it fails."""
    with tempfile.TemporaryDirectory(prefix="megaport-pretrain-") as workdir:
        cmd = command(tree, run, workdir)
        base = dict(os.environ if env is None else env)
        paths = [tree, base["PYTHONPATH"]] if base.get("PYTHONPATH") else [tree]
        run_env = {**base, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": os.pathsep.join(paths)}
        proc = subprocess.run(cmd.argv, cwd=cmd.cwd, env=run_env, capture_output=True, text=True, timeout=timeout)
    iterations = parse_log(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not iterations:
        raise RuntimeError(failure_message(proc.returncode, proc.stdout, proc.stderr, len(iterations)))
    ms = statistics.median_high([i.ms for i in iterations if i.iteration > run.warmup] or [i.ms for i in iterations])
    peaks = [float(v) for v in _MAX_ALLOCATED.findall(proc.stdout + proc.stderr)]
    return {"command": cmd.shell(), "data": cmd.data, "notes": cmd.notes,
            "losses": [i.loss for i in iterations], "iterations": [i.iteration for i in iterations],
            "ms_per_iter": ms, "tokens_per_s": run.batch * run.seq / (ms / 1000),
            "peak_memory_bytes": int(max(peaks) * 2**20) if peaks else None,
            "log": [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("> ROCm port:")]}


def failure_message(returncode: int, stdout: str, stderr: str, logged: int, lines: int = 25) -> str:
    """Why the run failed, in the rank's own words: torchrun's exit status is always 1 and its
    ChildFailedError report ends stderr, so the rank's exit code is read from that report and the
    report itself is left out of the quoted tail."""
    code = re.search(r"exitcode\s*:\s*(-?\d+)", stderr)
    launcher = stderr.find("Traceback (most recent call last)") if "ChildFailedError" in stderr else -1
    while launcher >= 0 and "torch/distributed" not in stderr[launcher:launcher + 400]:
        launcher = stderr.find("Traceback (most recent call last)", launcher + 1)
    own = stderr[:launcher] if launcher >= 0 else stderr
    tail = "\n".join((stdout.rstrip() + "\n" + own.rstrip()).strip().splitlines()[-lines:])
    status = f"exit code {code.group(1)}" if code else f"exit code {returncode}"
    return f"pretrain_gpt.py failed ({status}) after {logged} logged iterations:\n{tail}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True)
    parser.add_argument("--mode", choices=_gpt.MODES, default="ported")
    for name, default in (("layers", 2), ("hidden", 256), ("heads", 4), ("seq", 512), ("batch", 2),
                          ("steps", 30), ("warmup", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--print-command", action="store_true",
                        help="write the run's data files (eras without --mock-data) to --workdir, print the "
                             "command and exit")
    parser.add_argument("--workdir", help="where --print-command writes data files (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.tree, "pretrain_gpt.py")):
        parser.error(f"{args.tree} has no pretrain_gpt.py; give a Megatron-LM tree (megaport apply --dest DIR)")
    run = _gpt.Run(tree=os.path.abspath(args.tree), mode=args.mode, device="cuda", layers=args.layers,
                   hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch, steps=args.steps,
                   warmup=args.warmup)
    if args.print_command:
        workdir = args.workdir or tempfile.mkdtemp(prefix="megaport-pretrain-")
        os.makedirs(workdir, exist_ok=True)
        print(command(run.tree, run, workdir, port=29500).shell())
        return 0
    print(json.dumps(run_pretrain(run.tree, run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
