#!/usr/bin/env python3
"""Time `megaport apply` against `git worktree add` + `git apply` of the same patches, warm cache.

    python benchmarks/apply_vs_git.py --repo PATH_OR_URL --ref REF [--rounds 15]

Both sides start from megaport's cached bare repository (so no network on either side): the
baseline adds a worktree of it at the resolved commit and `git apply`s the patches megaport
applied (skipped ones left out); megaport runs its whole CLI in a fresh process, as a user would.
Rounds alternate the two so machine noise hits both. Prints medians and their ratio; asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(argv: list[str], **kwargs) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="upstream URL or local clone")
    parser.add_argument("--ref", required=True, help="upstream ref to port")
    parser.add_argument("--series", help="series to force (default: megaport chooses)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    from megaport.catalogue import load_catalogue
    from megaport.store import Store

    work = Path(tempfile.mkdtemp(prefix="megaport-bench-"))
    megaport = [sys.executable, "-m", "megaport.cli"]
    extra = ["--series", args.series] if args.series else []
    try:
        # Warm the cache and learn which patches apply.
        report_file = work / "report.json"
        subprocess.run([*megaport, "apply", "--ref", args.ref, "--repo", args.repo, "--dry-run",
                        "--json", str(report_file), *extra], check=True, capture_output=True)
        report = json.loads(report_file.read_text())
        series = load_catalogue().get(report["series"])
        applied = [str(series.directory / p["name"]) for p in report["patches"] if p["status"] == "applied"]
        cache = Store().resolve(args.repo, args.ref).repo
        sha = report["sha"]

        ours, baseline = [], []
        for round_ in range(args.rounds):
            dest = work / f"megaport-{round_}"
            ours.append(timed([*megaport, "apply", "--ref", args.ref, "--repo", args.repo, "--dest", str(dest), *extra]))
            tree = work / f"git-{round_}"
            start = time.perf_counter()
            subprocess.run(["git", "-C", str(cache), "worktree", "add", "-q", "--detach", str(tree), sha],
                           check=True, capture_output=True)
            subprocess.run(["git", "-C", str(tree), "apply", *applied], check=True, capture_output=True)
            baseline.append(time.perf_counter() - start)
            subprocess.run(["git", "-C", str(cache), "worktree", "remove", "--force", str(tree)],
                           check=True, capture_output=True)
            shutil.rmtree(dest)
        ours_median, base_median = statistics.median(ours), statistics.median(baseline)
        print(f"ref {args.ref} = {sha[:12]}, series {series.name}, {len(applied)} patches, {args.rounds} rounds")
        print(f"megaport apply                 median {ours_median * 1000:7.1f} ms  (min {min(ours) * 1000:.1f})")
        print(f"git worktree add + git apply   median {base_median * 1000:7.1f} ms  (min {min(baseline) * 1000:.1f})")
        print(f"ratio (median / median)        {ours_median / base_median:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
