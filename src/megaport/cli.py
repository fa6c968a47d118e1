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
    return run_apply(options, _console(json_file))


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
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if any series' copy differs from the source.")
@handle_errors
def regenerate(patches, check):
    """Maintainers: re-render the replacement module into every series.

    The PyTorch replacements live once, in megaport/replacements/rocm_port.py; each
    series carries them as a new-file diff. Edit the source, run this, commit the
    series. Unchanged series stay byte-for-byte identical.
    """
    from megaport.commands.regenerate import regenerate_series

    return regenerate_series(_console(), patches=str(patches) if patches else None, check=check)


if __name__ == "__main__":  # pragma: no cover
    main()
