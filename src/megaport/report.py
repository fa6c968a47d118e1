"""Results for people (rich tables) and for machines (JSON), from the same data."""

from __future__ import annotations

import json
from pathlib import Path

from megaport.plan import SeriesPlan


def plan_dict(plan: SeriesPlan) -> list[dict]:
    return [p.to_dict() for p in plan.patches]


def apply_report(
    *, url: str, ref: str, sha: str, plan: SeriesPlan | None, reason: str, status: str, dest: Path | None,
    error: str | None = None,
) -> dict:
    """The ``--json`` document: stable keys, documented in docs/cli.md."""
    return {
        "ref": ref,
        "sha": sha,
        "repo": url,
        "series": plan.series.name if plan else None,
        "reason": reason,
        "status": status,
        "dest": str(dest) if dest else None,
        "patches": plan_dict(plan) if plan else [],
        **({"error": error} if error else {}),
    }


def write_json(path: str | Path | None, document: dict) -> None:
    if path is None:
        return
    text = json.dumps(document, indent=2) + "\n"
    if str(path) == "-":
        print(text, end="")
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")


def hunk_summary(plan_patch) -> str:
    """'3 exact, 1 offset' style counts for one patch."""
    if plan_patch.result is None:
        return plan_patch.reason
    counts: dict[str, int] = {}
    for file_result in plan_patch.result.files:
        for hunk in file_result.hunks:
            counts[hunk.outcome] = counts.get(hunk.outcome, 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no hunks"


def render_plan(console, plan: SeriesPlan, title: str) -> None:
    """A table of patches: status and how their hunks landed."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("patch")
    table.add_column("status")
    table.add_column("hunks")
    styles = {"applied": "green", "already-applied": "cyan", "skipped": "yellow", "failed": "bold red"}
    for patch in plan.patches:
        style = styles.get(patch.status, "")
        table.add_row(patch.name, f"[{style}]{patch.status}[/]", hunk_summary(patch))
    console.print(table)
