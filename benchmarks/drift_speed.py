#!/usr/bin/env python3
"""How fast is `megaport drift`, and how does its time grow with refs and hunks?

    python benchmarks/drift_speed.py [--repo PATH] [--counts 5,10,20,40] [--rounds 3] [--cores 2]

--repo is an upstream clone with release tags, default the PyPI-built megatron/core repository
the tests build (~/.cache/megaport-tests/upstream-core, or $MEGAPORT_TEST_CACHE/upstream-core).
The script clones it into a temporary folder and grows a synthetic history on top of its newest
tag: 40 commits on branch `bench`, each drifting the files the series patch (lines inserted
above hunks, so every ref is different and most hunks land at an offset). Then it times, in a
fresh process pinned to --cores CPUs with a warm cache (no fetch; the cold first run is shown
separately):

* `--ref bench --last N` for each N in --counts, with `--series auto` (one series per ref) and
  `--series all` (every series on every ref: more hunks per ref);
* `--ref 'core_v*' --series all`: every series against every release tag of the repository.

It prints wall time, refs per minute, milliseconds per ref and per hunk checked (medians of
--rounds), and the process start-up time included in each. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_COMMITS = 40
DRIFTED = ("megatron/core/fusions/fused_softmax.py", "megatron/core/utils.py", "megatron/core/tensor_parallel/layers.py")


def default_repo() -> Path:
    cache = Path(os.environ.get("MEGAPORT_TEST_CACHE", "~/.cache/megaport-tests")).expanduser()
    return cache / "upstream-core"


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@invalid",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@invalid",
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000"}
    return subprocess.run(["git", "-c", "core.autocrlf=false", *args], cwd=cwd, env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def grow_history(source: Path, work: Path) -> Path:
    """A clone of ``source`` with BENCH_COMMITS drifting commits on branch ``bench``."""
    clone = work / "upstream"
    git(work, "clone", "--quiet", str(source), str(clone))
    newest = git(clone, "tag", "--list", "core_v*", "--sort=-version:refname").split()[0]
    git(clone, "checkout", "--quiet", "-b", "bench", newest)
    for number in range(1, BENCH_COMMITS + 1):
        for path in DRIFTED:
            target = clone / path
            if target.exists():
                text = target.read_text()
                target.write_text(f"# bench drift {number}\n" + text)
        git(clone, "commit", "--quiet", "-am", f"bench drift {number}")
    return clone


def run(argv: list[str], cores: int, env: dict[str, str]) -> tuple[float, str, int]:
    def pin() -> None:
        if hasattr(os, "sched_setaffinity"):
            available = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, available[:cores])

    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=pin)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1, 2):
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return elapsed, proc.stdout, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=default_repo(), help="upstream clone with core_v* tags")
    parser.add_argument("--counts", default="5,10,20,40", help="numbers of refs to time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2, help="CPUs the timed process may use")
    parser.add_argument("--patches", type=Path, help="catalogue to use (default: the built-in one)")
    args = parser.parse_args()
    if not args.repo.exists():
        raise SystemExit(f"{args.repo} does not exist; run the upstream tests once to build it, or pass --repo")
    counts = [int(c) for c in args.counts.split(",")]
    if max(counts) > BENCH_COMMITS:
        raise SystemExit(f"--counts go up to {BENCH_COMMITS}")

    work = Path(tempfile.mkdtemp(prefix="megaport-drift-bench-"))
    env = {**os.environ, "MEGAPORT_HOME": str(work / "home")}
    env.pop("MEGAPORT_PATCHES", None)
    if args.patches:
        env["MEGAPORT_PATCHES"] = str(args.patches.resolve())
    from megaport.catalogue import load_catalogue

    catalogue = load_catalogue(args.patches)
    hunks_per_series = {
        s.name: sum(len(f.hunks) for p in s.patches for f in _parse(p).files) for s in catalogue.series
    }
    megaport = [sys.executable, "-m", "megaport.cli"]
    try:
        clone = grow_history(args.repo, work)
        startup = statistics.median(run([*megaport, "--version"], args.cores, env)[0] for _ in range(args.rounds))
        cold, _, _ = run([*megaport, "drift", "--repo", str(clone), "--ref", "bench", "--last", str(BENCH_COMMITS),
                          "--format", "json"], args.cores, env)
        print(f"upstream {args.repo} + {BENCH_COMMITS} drifting commits; {args.cores} core(s); "
              f"median of {args.rounds}; python start-up {startup * 1000:.0f} ms (included below)")
        print(f"catalogue {catalogue.root}: {len(catalogue.series)} series, "
              f"{sum(hunks_per_series.values())} hunks ({', '.join(f'{n} {h}' for n, h in hunks_per_series.items())})")
        print(f"cold run (first fetch into an empty cache, {BENCH_COMMITS} refs, auto): {cold:.2f} s")
        print()
        print(f"{'refs':>5} {'series':>7} {'checks':>6} {'hunks':>6} {'wall s':>7} {'refs/min':>9} {'ms/ref':>7} {'ms/hunk':>8}  statuses")
        cases = [(n, mode, ["--ref", "bench", "--last", str(n)]) for mode in ("auto", "all") for n in counts]
        cases.append(("tags", "all", ["--ref", "core_v*"]))
        for label, mode, ref_args in cases:
            argv = [*megaport, "drift", "--repo", str(clone), *ref_args, "--series", mode, "--format", "json"]
            times, report = [], None
            for _ in range(args.rounds):
                elapsed, out, _ = run(argv, args.cores, env)
                times.append(elapsed)
                report = json.loads(out)
            wall = statistics.median(times)
            refs = len({r["sha"] for r in report["refs"]})
            hunks = sum(len(p["hunks"]) for r in report["refs"] for p in r["patches"])
            statuses: dict[str, int] = {}
            for r in report["refs"]:
                statuses[r["status"]] = statuses.get(r["status"], 0) + 1
            print(f"{refs if label == 'tags' else label:>5} {mode:>7} {len(report['refs']):>6} {hunks:>6} {wall:>7.2f} "
                  f"{refs / wall * 60:>9.0f} {wall / refs * 1000:>7.0f} {wall / max(hunks, 1) * 1000:>8.2f}  "
                  + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
                  + ("   (every core_v* tag)" if label == "tags" else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _parse(patch_file):
    from megaport.engine import parse_patch

    return parse_patch(patch_file.text(), name=patch_file.name)


if __name__ == "__main__":
    main()
