#!/usr/bin/env python3
"""Time `megaport apply` against plain git doing the same port, warm cache.

    python benchmarks/apply_vs_git.py --repo PATH_OR_URL --ref REF [--ref REF ...] [--rounds 5]

Every side starts from megaport's cached bare repository (no network anywhere) and ends with the
upstream commit checked out in a new repository:

* megaport: the whole CLI in a fresh process, as a user runs it (`python -m megaport.cli apply`),
  with its modules' bytecode as pip leaves it (PYTHONDONTWRITEBYTECODE, which some sandboxes set,
  is dropped: in an editable install it would recompile megaport's modules on every run);
* git am: `git clone --shared --no-checkout` of the cache, `git checkout -b megaport/<series>` of
  the commit, `git am` of the patches megaport applied. It gives what megaport gives, one commit
  per patch on a branch: the fair baseline;
* git apply: the same clone and checkout, then `git apply` of those patches (files only, no
  commits): the floor.

Rounds alternate the three (megaport, git am, git apply, megaport, ...) so machine noise hits all
of them. Per ref it prints each side's median, the ratio megaport / git am and megaport's fixed
cost (megaport - git am, in ms); `--json FILE` writes the same. Asserts nothing.
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

# git am needs an identity; these keep the baseline independent of the user's git config.
IDENTITY = {
    "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
    "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost",
}  # fmt: skip


def run(argv: list[str], **kwargs) -> None:
    subprocess.run(argv, check=True, capture_output=True, **kwargs)


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


class Bench:
    """The three ways of porting one ref, each timed into a fresh directory under ``work``."""

    def __init__(self, repo: str, ref: str, series: str | None, work: Path) -> None:
        from megaport.catalogue import load_catalogue
        from megaport.store import Store

        self.repo, self.ref, self.work = repo, ref, work
        self.megaport = [sys.executable, "-m", "megaport.cli", "apply", "--ref", ref, "--repo", repo]
        self.megaport += ["--series", series] if series else []
        self.megaport_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        # Warm the cache (and the bytecode) and learn which patches apply.
        report_file = work / "report.json"
        run([*self.megaport, "--dry-run", "--json", str(report_file)], env=self.megaport_env)
        report = json.loads(report_file.read_text())
        self.series = load_catalogue().get(report["series"])
        paths = {p.name: p.path for p in self.series.patches}  # shared port patches live in port/
        self.patches = [str(paths[p["name"]]) for p in report["patches"] if p["status"] == "applied"]
        self.cache = str(Store().resolve(repo, ref).repo)
        self.sha = report["sha"]
        self.env = {**os.environ, **IDENTITY}
        self.count = 0

    def _dest(self, side: str) -> Path:
        self.count += 1
        return self.work / f"{side}-{self.count}"

    def run_megaport(self) -> float:
        dest = self._dest("megaport")
        took = timed(lambda: run([*self.megaport, "--dest", str(dest)], env=self.megaport_env))
        shutil.rmtree(dest)
        return took

    def run_git(self, command: str) -> float:
        """``command`` is ``am`` or ``apply``."""
        tree = self._dest(f"git-{command}")

        def port() -> None:
            run(["git", "clone", "--quiet", "--shared", "--no-checkout", self.cache, str(tree)])
            run(["git", "-C", str(tree), "checkout", "--quiet", "-b", f"megaport/{self.series.name}", self.sha])
            run(["git", "-C", str(tree), command, "--quiet", *self.patches], env=self.env)

        took = timed(port)
        shutil.rmtree(tree)
        return took

    def measure(self, rounds: int) -> dict:
        times: dict[str, list[float]] = {"megaport": [], "git am": [], "git apply": []}
        for _ in range(rounds):
            times["megaport"].append(self.run_megaport())
            times["git am"].append(self.run_git("am"))
            times["git apply"].append(self.run_git("apply"))
        medians = {side: statistics.median(values) for side, values in times.items()}
        return {
            "ref": self.ref, "sha": self.sha, "series": self.series.name, "patches": len(self.patches),
            "rounds": rounds, "median_s": medians, "min_s": {side: min(v) for side, v in times.items()},
            "ratio_vs_git_am": medians["megaport"] / medians["git am"],
            "fixed_cost_s": medians["megaport"] - medians["git am"],
        }  # fmt: skip


def show(result: dict) -> None:
    print(f"ref {result['ref']} = {result['sha'][:12]}, series {result['series']}, "
          f"{result['patches']} patches, {result['rounds']} rounds")
    labels = {"megaport": "megaport apply", "git am": "clone --shared + checkout + git am",
              "git apply": "clone --shared + checkout + git apply"}
    for side, label in labels.items():
        print(f"  {label:<40} median {result['median_s'][side] * 1000:7.1f} ms  (min {result['min_s'][side] * 1000:.1f})")
    print(f"  ratio vs git am {result['ratio_vs_git_am']:.2f}x, fixed cost {result['fixed_cost_s'] * 1000:+.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="upstream URL or local clone")
    parser.add_argument("--ref", required=True, action="append", help="upstream ref to port (repeatable)")
    parser.add_argument("--series", help="series to force (default: megaport chooses)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="megaport-bench-"))
    results = []
    try:
        for ref in args.ref:
            results.append(Bench(args.repo, ref, args.series, work).measure(args.rounds))
            show(results[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
