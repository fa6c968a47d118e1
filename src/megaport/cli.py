"""Command line: parse arguments, call one command function, turn known failures into one line.

Every command is a plain function in ``megaport.commands``; this module only wires click to them
and owns the single place where errors are printed.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path

import click

from megaport import __version__
from megaport.errors import MegaportError

DEFAULT_UPSTREAM = "https://github.com/NVIDIA/Megatron-LM.git"
UPSTREAM_ENV = "MEGAPORT_UPSTREAM"


def _console(json_file: str | None = None):
    """Rich output for people; on stderr when stdout carries the JSON report."""
    from rich.console import Console

    stream = sys.stderr if json_file == "-" else sys.stdout
    # Logs and CI captures are not terminals: give tables room instead of rich's 80 columns.
    width = None if stream.isatty() else 160
    return Console(highlight=False, stderr=json_file == "-", width=width, soft_wrap=True)


def _log_path() -> Path:
    from megaport.store import default_home

    return default_home() / "megaport.log"


def handle_errors(command):
    """Known failures → 'megaport: error: …' and their exit code; anything else → log file + one line."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            code = command(*args, **kwargs)
        except MegaportError as exc:
            click.echo(f"megaport: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("megaport: interrupted; nothing half-written was kept", err=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the one place that catches everything
            log = _log_path()
            try:
                log.parent.mkdir(parents=True, exist_ok=True)
                with log.open("a", encoding="utf-8") as handle:
                    handle.write(traceback.format_exc())
                where = f"; details in {log}"
            except OSError:
                where = ""
            click.echo(f"megaport: unexpected error: {type(exc).__name__}: {exc}{where}", err=True)
            sys.exit(3)
        sys.exit(code or 0)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="megaport")
def main() -> None:
    """Port upstream NVIDIA Megatron-LM to AMD ROCm GPUs with versioned patch series.

    \b
    Typical use:
      megaport apply --ref core_v0.16.1 --dest Megatron-LM-rocm
      megaport status Megatron-LM-rocm
      megaport series

    The series replace the fused CUDA softmax with PyTorch functions that keep the
    kernels' semantics, remove NVIDIA apex and the fused-kernel build, and make RCCL
    the distributed backend.
    """


@main.command()
@click.option("--ref", required=True, help="Upstream commit, tag or branch to port (e.g. core_v0.16.1, main, 5be9626).")
@click.option(
    "--repo",
    default=lambda: os.environ.get(UPSTREAM_ENV, DEFAULT_UPSTREAM),
    show_default=f"${UPSTREAM_ENV} or {DEFAULT_UPSTREAM}",
    help="Upstream git URL, file:// URL or local clone.",
)
@click.option(
    "--dest",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("Megatron-LM"),
    show_default=True,
    help="Directory to create as the ported git work tree (new, empty, or an earlier port of the same ref).",
)
@click.option("--series", "series_name", metavar="NAME", help="Use this series instead of choosing one (see 'megaport series').")
@click.option(
    "--patches",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    envvar="MEGAPORT_PATCHES",
    help="Catalogue directory to use instead of the built-in one [env: MEGAPORT_PATCHES].",
)
@click.option("--json", "json_file", metavar="FILE", help="Also write the report as JSON ('-' for stdout).")
@click.option("--dry-run", is_flag=True, help="Show the chosen series and every hunk's outcome; write nothing.")
@click.option(
    "--fuzz",
    "max_fuzz",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="Context lines a hunk may ignore to land. Keep 0: fuzz means the series needs a refresh.",
)
@handle_errors
def apply(ref, repo, dest, series_name, patches, json_file, dry_run, max_fuzz):
    """Clone upstream at --ref, choose the matching series, and apply it.

    Each patch becomes its own commit on branch megaport/<series> in DEST. If any
    hunk fails, nothing is written and the error names the patch, file, hunk and
    the nearest matching lines. Re-running on the same port does nothing.
    """
    from megaport.commands.apply import ApplyOptions
    from megaport.commands.apply import apply as run_apply

    options = ApplyOptions(
        ref=ref, repo=repo, dest=dest, series=series_name, patches=str(patches) if patches else None,
        json_file=json_file, dry_run=dry_run, max_fuzz=max_fuzz,
    )
    return run_apply(options, lambda: _console(json_file))


@main.command()
@click.argument("tree", type=click.Path(path_type=Path, file_okay=False), default=Path("."), required=False)
@click.option("--json", "json_file", metavar="FILE", help="Also write the status as JSON ('-' for stdout).")
@click.option("--patches", type=click.Path(path_type=Path, file_okay=False, exists=True), envvar="MEGAPORT_PATCHES",
              help="Catalogue to compare the applied series with [env: MEGAPORT_PATCHES].")
@handle_errors
def status(tree, json_file, patches):
    """Show what a ported TREE holds (default: current directory), offline.

    Exit 0 when the patched files are as megaport wrote them, 1 when any changed.
    """
    from megaport.commands.status import status as run_status

    return run_status(tree, _console(json_file), json_file=json_file, patches=str(patches) if patches else None)


@main.command()
@click.option("--patches", type=click.Path(path_type=Path, file_okay=False, exists=True), envvar="MEGAPORT_PATCHES",
              help="Catalogue directory to list [env: MEGAPORT_PATCHES].")
@click.option("--json", "json_file", metavar="FILE", help="Also write the catalogue as JSON ('-' for stdout).")
@handle_errors
def series(patches, json_file):
    """List the patch series: era, upstream refs each is tested against, patch count."""
    from megaport.commands.series import list_series

    return list_series(_console(json_file), patches=str(patches) if patches else None, json_file=json_file)


@main.command()
@click.option("--patches", type=click.Path(path_type=Path, file_okay=False, exists=True), envvar="MEGAPORT_PATCHES",
              help="Catalogue whose series to regenerate [env: MEGAPORT_PATCHES].")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if any copy differs from the source.")
@handle_errors
def regenerate(patches, check):
    """Maintainers: re-render the replacement package into the shared port patches.

    The PyTorch replacements live once, in megaport/replacements/rocm_port/, and
    once in the catalogue: patches/port/ holds the patch that adds the package and one
    small patch per [[port]] variant, which every series lists first. Edit the source,
    run this, commit patches/. Unchanged files stay byte-for-byte identical.
    """
    from megaport.commands.regenerate import regenerate_series

    return regenerate_series(_console(), patches=str(patches) if patches else None, check=check)


class _UsageExit3(click.Command):
    """drift/refresh/lint: a usage error exits 3, because their exit code 2 means 'conflict'."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            exc.exit_code = 3
            raise


_PATCHES_OPTION = click.option(
    "--patches", type=click.Path(path_type=Path, file_okay=False, exists=True), envvar="MEGAPORT_PATCHES",
    help="Catalogue directory to use instead of the built-in one [env: MEGAPORT_PATCHES].",
)
_REPO_OPTION = click.option(
    "--repo", default=lambda: os.environ.get(UPSTREAM_ENV, DEFAULT_UPSTREAM),
    show_default=f"${UPSTREAM_ENV} or {DEFAULT_UPSTREAM}", help="Upstream git URL, file:// URL or local clone.",
)


@main.command(cls=_UsageExit3)
@click.option("--ref", "refs", multiple=True, required=True, metavar="REF",
              help="Tag, branch or sha; a tag glob ('core_v0.1*'); or a range 'A..B' (main~10..main). Repeatable.")
@click.option("--last", type=click.IntRange(min=1), metavar="N",
              help="Each plain --ref stands for its newest N first-parent commits (like REF~N..REF).")
@_REPO_OPTION
@click.option("--series", "series_names", multiple=True, default=("auto",), show_default=True, metavar="NAME|auto|all",
              help="auto: the series megaport would choose for each ref; all: every series on every ref; or names.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown", "junit", "github"]), default="text",
              show_default=True, help="Report format (github: workflow annotations on the patch files).")
@click.option("--output", metavar="FILE", help="Write the report to FILE instead of stdout.")
@click.option("--summary", metavar="FILE", help="Also append the Markdown report to FILE (e.g. $GITHUB_STEP_SUMMARY).")
@click.option("--fuzz", "max_fuzz", type=click.IntRange(0, 3), default=2, show_default=True,
              help="Most context lines a hunk may ignore to count as 'fuzz' rather than a merge or a conflict.")
@click.option("--apply-fuzz", "apply_fuzz", type=click.IntRange(0, 3), default=0, show_default=True,
              help="Judge each ref as 'megaport apply --fuzz N' would: where it refuses, exit 2 with its reason.")
@_PATCHES_OPTION
@handle_errors
def drift(refs, last, repo, series_names, fmt, output, summary, max_fuzz, apply_fuzz, patches):
    """Check how each series fits upstream refs, hunk by hunk, without checking anything out.

    \b
    Every hunk is clean, offset N, fuzz N, 3way (only a three-way merge with
    the patch's preimage works), applied (upstream has it), missing (file gone;
    likely new path given) or conflict (nearest match and similarity given).
    Exit 0 all clean, 1 drift that still applies, 2 a conflict or missing file,
    or a series 'megaport apply' refuses (same reason), 3 usage or environment error. docs/drift.md has the JSON shape and CI recipes.
    """
    from megaport.commands.drift import drift as run_drift_command
    from megaport.drift.run import DriftOptions

    options = DriftOptions(
        repo=repo, refs=tuple(refs), series=tuple(series_names), patches=str(patches) if patches else None,
        last=last, max_fuzz=max_fuzz, apply_fuzz=apply_fuzz,
    )
    return run_drift_command(options, _console(), fmt=fmt, output=output, summary=summary)


@main.command(cls=_UsageExit3)
@click.option("--series", "series_name", required=True, metavar="NAME", help="The series to rebuild.")
@click.option("--ref", required=True, help="Upstream ref to rebuild it on.")
@click.option("--as", "as_name", metavar="NEW", help="Write the result as a new series NEW (folder + catalogue entry).")
@click.option("--in-place", is_flag=True, help="Rewrite the series' own patch files.")
@_REPO_OPTION
@_PATCHES_OPTION
@handle_errors
def refresh(series_name, ref, as_name, in_place, repo, patches):
    """Rebuild a series on REF (offset, fuzz or three-way) and export it.

    Patches whose hunks are all clean keep every byte; the others are rediffed with
    three lines of context. Without --as or --in-place it only previews. When a hunk
    conflicts, the hunks are listed and nothing is written (exit 2).
    """
    from megaport.commands.refresh import RefreshOptions
    from megaport.commands.refresh import refresh as run_refresh

    options = RefreshOptions(
        series=series_name, ref=ref, repo=repo, patches=str(patches) if patches else None,
        as_name=as_name, in_place=in_place,
    )
    return run_refresh(options, _console())


@main.command(cls=_UsageExit3)
@_PATCHES_OPTION
@click.option("--format", "fmt", type=click.Choice(["text", "github"]), default="text", show_default=True,
              help="github: workflow annotations.")
@handle_errors
def lint(patches, fmt):
    """Check the catalogue: subjects, reasons, Upstream-Range trailers, folders, paths, rules.

    Exit 0 clean, 1 problems (one line each: where and what to do), 3 usage error.
    """
    from megaport.commands.lint import lint as run_lint

    return run_lint(_console(), patches=str(patches) if patches else None, fmt=fmt)


@main.command()
@click.argument("tree", type=click.Path(path_type=Path, file_okay=False), default=Path("."), required=False)
@click.option("--device", type=click.Choice(["auto", "hip", "cuda", "cpu"]), default="auto", show_default=True,
              help="Where the tests run; auto picks the GPU when torch sees one.")
@click.option("--json", "json_file", metavar="FILE", help="Also write device, tests and summary as JSON ('-' for stdout).")
@click.option("--junit", "junit_file", metavar="FILE", help="Also write a JUnit XML report (pytest's --junitxml).")
@click.option("-k", "keyword", metavar="EXPR", help="Run only the tests matching EXPR (pytest's -k).")
@click.option("--strict", is_flag=True,
              help="Count every skipped test as a failure (a skip is only ever an optional upstream "
                   "dependency that is not installed, or a GPU-only check on a CPU).")
@click.option("--patches", type=click.Path(path_type=Path, file_okay=False, exists=True), envvar="MEGAPORT_PATCHES",
              help="Catalogue that holds the tree's series [env: MEGAPORT_PATCHES].")
@click.option("--model", "models", metavar="NAMES",
              help="Model families to train, comma-separated (gpt, bert, t5, llama, llama3, mixtral, deepseek); "
                   "default: every family the tree has.")
@click.option("--layouts", metavar="NAMES",
              help="Parallel layouts to train, comma-separated (tp2, tp2-sp, pp2, pp2-vpp, dp2-distopt, "
                   "dp2-zero1, tp2-recompute, tp2-selective, dp2-fsdp2, cp2, ep2, tp2-pp2, tp2-cp2, ep2-tp2, two-nodes), 'all' or 'none'; "
                   "default: every layout the era has, each with its families.")
@click.option("--checks", metavar="NAMES",
              help="What each layout is compared with: one-rank (one rank from the same checkpoint), "
                   "upstream (unported upstream in the same layout), tp-replicas (under sequence parallelism, the "
                   "TP ranks' copies of the norms stay equal), resume (saved halfway and resumed = uninterrupted, "
                   "where the optimizer is sharded), layout-change (tp2/pp2/ep2's checkpoint loads on one rank), cross-load "
                   "(unported upstream resumes the port's checkpoint and the port upstream's); "
                   "default: all, where they apply.")
@handle_errors
def verify(tree, device, json_file, junit_file, keyword, strict, patches, models, layouts, checks):
    """Run the smoke suite against a ported TREE's own code (default: current directory).

    \b
    Imports of every touched module (no apex, amp_C or *_cuda), the fused softmax and
    the apex substitutes against fp64/PyTorch references with the era's semantics,
    two ranks with the tree's backend (RCCL on ROCm, gloo on CPU) and TP=2 layers,
    and a few steps of every model family the tree has (GPT, BERT, T5, Llama,
    Mixtral, DeepSeek: each through upstream's own entry point with its example's
    flags, with loss parity against unported upstream; --model picks some).
    Then every parallel layout the era has (TP, SP, PP with interleaving, DP with
    the distributed optimizer, CP, EP, two nodes on 127.0.0.1) trains on 2 or 4
    ranks and must match one rank from the same checkpoint (--layouts picks some).
    Runs under pytest in a fresh process.

    A failure caused by the port, or by old upstream code that today's torch,
    NumPy or Python broke (torch._six, np.float, an unguarded TransformerEngine
    import), fails; every skip is listed with its reason.

    Exit 0 when every test that ran passed (and, with --strict, none skipped),
    1 when any failed, 2 for usage or environment problems (not a ported tree,
    no torch, no such device).
    """
    from megaport.commands.verify import VerifyOptions
    from megaport.commands.verify import verify as run_verify

    options = VerifyOptions(tree=tree, device=device, json_file=json_file, junit_file=junit_file, keyword=keyword,
                            strict=strict, patches=str(patches) if patches else None, models=models,
                            layouts=layouts, checks=checks)
    return run_verify(options, _console(json_file))


@main.command()
@click.option("--json", "json_file", metavar="FILE", help="Also write the findings as JSON ('-' for stdout).")
@handle_errors
def doctor(json_file):
    """Check this machine for running ported Megatron: ROCm/HIP, torch, GPUs, RCCL, environment.

    Lists versions, gfx arch and the variables that matter on ROCm, and warns about
    known-bad settings, each with what to do. Exit 1 when a finding is an error
    (e.g. no torch, or a CUDA build of torch on a ROCm machine), else 0.
    """
    from megaport.commands.doctor import doctor as run_doctor

    return run_doctor(_console(json_file), json_file=json_file)


@main.command()
@click.argument("tree", type=click.Path(path_type=Path, file_okay=False), default=Path("."), required=False)
@click.option("--device", type=click.Choice(["auto", "hip", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--shape", default="1,16,1024,1024", show_default=True, metavar="B,NP,SQ,SK",
              help="Attention scores shape [b, np, sq, sk] (three numbers: [b*np, sq, sk]).")
@click.option("--dtype", "dtypes", default="bf16,fp32", show_default=True, metavar="LIST",
              help="Comma-separated: bf16, fp16, fp32.")
@click.option("--causal", "mask_kind", flag_value="causal", default=True, help="Causal mask (default).")
@click.option("--mask", "mask_kind", flag_value="padding", help="Padding mask ([b, 1, sq, sk], 10%% masked).")
@click.option("--none", "mask_kind", flag_value="none", help="No mask.")
@click.option("--repeats", type=click.IntRange(1, 10000), default=15, show_default=True,
              help="Timed fwd+bwd runs per variant (interleaved); medians are reported.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="CPU threads for torch (torch.set_num_threads); default: torch's own choice.")
@click.option("--json", "json_file", metavar="FILE", help="Also write the measurements as JSON ('-' for stdout).")
@click.option("--attention", is_flag=True,
              help="Benchmark core attention instead: the port's SDPA call, the port's softmax path and "
                   "upstream's unfused path, fwd+bwd, per shape and dtype.")
@click.option("--shapes", default="2,8,512;2,8,1024;2,8,2048", show_default=True,
              help="--attention: b,heads,seq per shape, ';' between shapes.")
@click.option("--head-dim", type=click.IntRange(1), default=64, show_default=True, help="--attention: head dim.")
@click.option("--groups", type=click.IntRange(1), help="--attention: query groups (GQA) [one per head].")
@click.option("--dropout", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.0, show_default=True,
              help="--attention: attention dropout in every variant (on the CPU the port's SDPA call then runs its "
                   "blockwise kernel: SDPA's CPU flash kernel takes no dropout).")
@click.option("--fusions", is_flag=True,
              help="Time the TE fusions a ROCm box runs unfused (RoPE, SwiGLU, RMSNorm, cross-entropy), eager and "
                   "compiled, with their estimated share of an iteration (--seq/--batch/--hidden/--heads/--groups/"
                   "--layers set the shapes).")
@click.option("--train", is_flag=True,
              help="Benchmark training instead: the port against upstream with its fusions off.")
@click.option("--layers", type=click.IntRange(1), help="--train: transformer layers [GPU 8, CPU 2].")
@click.option("--hidden", type=click.IntRange(1), help="--train: hidden size [GPU 2048, CPU 256].")
@click.option("--heads", type=click.IntRange(1), help="--train: attention heads [GPU 16, CPU 4].")
@click.option("--seq", type=click.IntRange(1), help="--train: sequence length [GPU 2048, CPU 512].")
@click.option("--batch", type=click.IntRange(1), help="--train: micro-batch size [GPU 4, CPU 2].")
@click.option("--steps", type=click.IntRange(2), help="--train: training iterations per run [40].")
@click.option("--warmup", type=click.IntRange(0),
              help="--train: logged iterations left out of the timing [GPU 5, CPU 3].")
@click.option("--rounds", type=click.IntRange(1, 100), default=1, show_default=True,
              help="--train: runs of each side, alternating which goes first; medians are reported.")
@click.option("--entry", type=click.Choice(["auto", "pretrain", "harness"]), default="auto", show_default=True,
              help="--train: the tree's own pretrain_gpt.py under torchrun (on CPU with megaport's substitutions "
                   "for CUDA-only plumbing), or megaport's harness on upstream's builders (trees from PyPI's "
                   "megatron-core); auto takes pretrain_gpt.py where the tree has it.")
@click.option("--model", default="gpt", show_default=True, metavar="NAME",
              help="--train: the model family (gpt, bert, t5, llama, llama3, mixtral, deepseek), through its own "
                   "entry point with its example's flags.")
@click.option("--layout", default="one-rank", show_default=True, metavar="NAME",
              help="--train: how each side is spread over ranks (tp2, tp2-sp, pp2, dp2-distopt, cp2, ep2, ...: "
                   "the layouts verify trains), both sides the same.")
@handle_errors
def bench(tree, device, shape, dtypes, mask_kind, repeats, threads, json_file, attention, shapes, head_dim, groups,
          dropout, fusions, train, layers, hidden, heads, seq, batch, steps, warmup, rounds, entry, model, layout):
    """Time the tree's replacement softmax against upstream's torch fallback, or (--train)
    training against upstream with its fusions off.

    \b
    Softmax: both from the TREE's own FusedScaleMaskSoftmax: its fused path (the
    port's replacement) and forward_torch_softmax (upstream's fallback), forward +
    backward, medians over interleaved runs, peak memory, and achieved bandwidth
    against a plain copy of the same tensors.
    \b
    --attention: core attention, fwd+bwd, on [seq, b, heads, head-dim] query, key
    and value: the port's scaled_dot_product_attention call, the port's softmax path
    (two GEMMs around the kernel replacement) and upstream's unfused path, with
    ms, peak memory and the ratios to unfused, per --shapes and --dtype (and
    --dropout: the CPU then runs the port's blockwise kernel).
    \b
    --train: the ported tree's own pretrain_gpt.py with the era's example flags
    (shrunk), and the tree's unported upstream commit with the fusions off (exported
    next to it; the tree is not touched), same seed, data and flags: ms/iter,
    tokens/s, peak memory, the loss per logged iteration, and the ratios. Trees
    without pretrain_gpt.py (PyPI's megatron-core) run megaport's harness on
    upstream's megatron.core builders instead.
    \b
    Measures; never asserts.
    """
    if fusions:
        from megaport.commands.bench_fusions import FusionBenchOptions, bench_fusions

        given = dict(seq=seq, batch=batch, hidden=hidden, heads=heads, groups=groups, layers=layers)
        return bench_fusions(FusionBenchOptions(device=device, dtype=dtypes.split(",")[0].strip(),
                                                repeats=repeats, json_file=json_file,
                                                **{k: v for k, v in given.items() if v is not None}),
                             _console(json_file))
    if attention:
        from megaport.commands.bench_attention import AttentionBenchOptions, bench_attention

        return bench_attention(AttentionBenchOptions(tree=tree, device=device, shapes=shapes, head_dim=head_dim,
                                                     groups=groups, dtypes=dtypes, mask=mask_kind,
                                                     dropout=dropout, repeats=repeats, json_file=json_file),
                               _console(json_file))
    if train:
        from megaport.commands.bench_train import TrainBenchOptions, bench_train
        from megaport.train.layouts import registry as layouts

        sizes = dict(layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, steps=steps, warmup=warmup)
        return bench_train(TrainBenchOptions(tree=tree, device=device, sizes=sizes, rounds=rounds,
                                             json_file=json_file, entry=entry, model=model,
                                             layout=layouts.get(layout).name), _console(json_file))
    from megaport.commands.bench import BenchOptions
    from megaport.commands.bench import bench as run_bench

    options = BenchOptions(tree=tree, device=device, shape=shape, dtypes=dtypes, mask=mask_kind, repeats=repeats,
                           threads=threads, json_file=json_file)
    return run_bench(options, _console(json_file))


if __name__ == "__main__":  # pragma: no cover
    main()
