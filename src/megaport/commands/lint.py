"""``megaport lint``: static checks of the series catalogue (exit 0 clean, 1 problems, 3 usage)."""

from __future__ import annotations

from typing import Optional

import click

from megaport.catalogue import patches_dir
from megaport.drift.lint import lint_catalogue


def lint(console, *, patches: Optional[str] = None, fmt: str = "text") -> int:
    root = patches_dir(patches)
    problems = lint_catalogue(root)
    if fmt == "github":
        for problem in problems:
            where = problem.where()
            file, _, line = where.rpartition(":") if problem.line else (where, "", "")
            props = f"file={_escape(file, True)}" + (f",line={line}" if line else "")
            click.echo(f"::error {props},title=megaport lint::{_escape(problem.message, False)}")
    else:
        for problem in problems:
            click.echo(problem.render())
    summary = f"{len(problems)} problem(s) in {root}" if problems else f"{root}: no problems"
    click.echo(summary)
    return 1 if problems else 0


def _escape(text: str, prop: bool) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text
