"""``megaport drift``: how well each series still fits upstream refs, hunk by hunk.

Exit codes (stable, for CI): 0 every hunk clean, 1 drift that still applies (offset, fuzz,
3way, applied), 2 a conflict or a missing file, 3 a usage or environment error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from megaport.drift.model import EXIT_USAGE
from megaport.drift.render import print_text, render, render_markdown
from megaport.drift.run import DriftOptions, run_drift
from megaport.errors import MegaportError


def drift(
    options: DriftOptions,
    console,
    *,
    fmt: str = "text",
    output: Optional[str] = None,
    summary: Optional[str] = None,
) -> int:
    """Check, then write the report in ``fmt`` to stdout or ``output`` (and Markdown appended to
    ``summary``, e.g. ``$GITHUB_STEP_SUMMARY``). Returns the exit code."""
    try:
        report = run_drift(options)
    except MegaportError as exc:
        raise MegaportError(str(exc), exit_code=EXIT_USAGE) from None
    if output and output != "-":
        _write(Path(output), render(report, fmt), append=False)
    elif fmt == "text":
        print_text(console, report)
    else:
        click.echo(render(report, fmt), nl=False)
    if summary:
        _write(Path(summary), render_markdown(report), append=True)
    return report.exit_code


def _write(path: Path, text: str, *, append: bool) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a" if append else "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise MegaportError(f"cannot write {path}: {exc.strerror}", exit_code=EXIT_USAGE) from None
