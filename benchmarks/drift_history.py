#!/usr/bin/env python3
"""How does `megaport drift --last N` grow with N over a long history? A CPU proxy for
`megaport drift --ref main --last 4654` on a full upstream clone.

    python benchmarks/drift_history.py [--repo PATH] [--steps 3] [--counts 300,1000,all] [--cores 2]

--repo is an upstream clone whose first-parent history on ``main`` holds release commits, default
the PyPI-built megatron/core repository the tests build (~/.cache/megaport-tests/upstream-core, 20
releases). Between each two releases the script interpolates --steps commits per changed file
(each a growing share of the file's changed line blocks; deletions at the last step), so the
history on branch ``hist`` has about 4,400 commits for --steps 3 and ends at the newest
release's exact tree: many commits sit between two series' ranges, as upstream's do. It then
times `megaport drift --ref hist --last N --series auto` in a fresh process pinned to --cores
CPUs with a warm cache, and prints wall time, refs per minute and the series/status counts.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drift_speed import default_repo, run  # noqa: E402  (same repository and timing as drift_speed)


def git(cwd: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=cwd, input=data, capture_output=True, check=True).stdout


def partial(old: bytes, new: bytes, share: float) -> bytes:
    """``old`` with the first ``share`` of its changed line blocks towards ``new`` made."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    changed = [i for i, op in enumerate(ops) if op[0] != "equal"]
    taken = set(changed[: round(len(changed) * share)])
    out: list[bytes] = []
    for i, (tag, i1, i2, j1, j2) in enumerate(ops):
        out.extend(b[j1:j2] if tag == "equal" or i in taken else a[i1:i2])
    return b"".join(out)


def grow_history(source: Path, work: Path, steps: int) -> tuple[Path, int]:
    """A bare clone of ``source`` with the interpolated history on branch ``hist``; its length."""
    clone = work / "upstream.git"
    git(work, "clone", "--quiet", "--bare", str(source), str(clone))
    releases = git(clone, "rev-list", "--first-parent", "--reverse", "main").decode().split()
    stream: list[bytes] = []

    def commit(message: str, change: bytes) -> None:
        mark = len(stream) + 1
        parent = f"from {releases[0]}\n" if mark == 1 else ""
        stream.append(
            f"commit refs/heads/hist\nmark :{mark}\ncommitter bench <bench@invalid> {1_600_000_000 + mark * 3600} +0000\n"
            f"data {len(message)}\n{message}\n{parent}".encode() + change
        )

    commit("start", b"")
    for old, new in zip(releases, releases[1:]):
        rows = git(clone, "diff-tree", "-r", "-z", "--no-renames", old, new).split(b"\0")
        files = [(rows[i].decode().split(), rows[i + 1].decode()) for i in range(0, len(rows) - 1, 2)]
        for step in range(1, steps + 1):
            for meta, path in files:
                mode, status = meta[1], meta[4]
                if status == "D":
                    if step == steps:
                        commit(f"remove {path}", f"D {path}\n".encode())
                    continue
                data = git(clone, "cat-file", "blob", f"{new}:{path}")
                if status == "M" and step < steps:
                    data = partial(git(clone, "cat-file", "blob", f"{old}:{path}"), data, step / steps)
                commit(f"{path} step {step}", f"M {mode} inline {path}\ndata {len(data)}\n".encode() + data + b"\n")
    git(clone, "fast-import", "--quiet", data=b"".join(stream) + b"done\n")
    same = git(clone, "rev-parse", "hist^{tree}") == git(clone, "rev-parse", f"{releases[-1]}^{{tree}}")
    assert same, "the interpolated history must end at the newest release's tree"
    return clone, len(stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=default_repo(), help="upstream clone with releases on main")
    parser.add_argument("--steps", type=int, default=3, help="commits per changed file between two releases")
    parser.add_argument("--counts", default="300,1000,all", help="--last values to time ('all': the whole history)")
    parser.add_argument("--cores", type=int, default=2, help="CPUs the timed process may use")
    args = parser.parse_args()
    if not args.repo.exists():
        raise SystemExit(f"{args.repo} does not exist; run the upstream tests once to build it, or pass --repo")
    work = Path(tempfile.mkdtemp(prefix="megaport-drift-history-"))
    env = {**os.environ, "MEGAPORT_HOME": str(work / "home")}
    env.pop("MEGAPORT_PATCHES", None)
    megaport = [sys.executable, "-m", "megaport.cli"]
    try:
        clone, length = grow_history(args.repo, work, args.steps)
        counts = [length if c == "all" else int(c) for c in args.counts.split(",")]
        warm = [*megaport, "drift", "--repo", str(clone), "--ref", "hist", "--last", "1", "--format", "json"]
        run(warm, args.cores, env)  # the cache's first fetch is not what is measured
        print(f"{args.repo} interpolated to {length} first-parent commits ({args.steps} steps per changed file); "
              f"{args.cores} core(s); warm cache; one run each")
        print(f"{'refs':>6} {'wall s':>8} {'refs/min':>9} {'ms/ref':>7}  series chosen (refs)")
        for count in counts:
            argv = [*megaport, "drift", "--repo", str(clone), "--ref", "hist", "--last", str(count), "--format", "json"]
            wall, out, _ = run(argv, args.cores, env)
            report = json.loads(out)
            chosen = Counter(r["series"] for r in report["refs"])
            print(f"{count:>6} {wall:>8.1f} {count / wall * 60:>9.0f} {wall / count * 1000:>7.1f}  "
                  + ", ".join(f"{name} {n}" for name, n in chosen.most_common()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
