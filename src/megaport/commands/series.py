"""``megaport series``: the catalogue, as a table or JSON."""

from __future__ import annotations

from megaport.catalogue import load_catalogue
from megaport.report import write_json


def list_series(console, *, patches: str | None = None, json_file: str | None = None) -> int:
    from rich.table import Table

    catalogue = load_catalogue(patches)
    table = Table(title=f"series in {catalogue.root}", title_justify="left", show_edge=False)
    for column in ("series", "era", "repository", "tested against", "lines", "port", "patches", "summary"):
        table.add_column(column)
    for series in catalogue.series:
        table.add_row(series.name, series.era, series.repository, series.tested_range, ", ".join(series.lines),
                      series.port or "-", str(len(series.patches)), series.summary)
    console.print(table)
    write_json(
        json_file,
        {
            "catalogue": str(catalogue.root),
            "series": [
                {
                    "name": s.name,
                    "era": s.era,
                    "repository": s.repository,
                    "summary": s.summary,
                    "tested": [{"ref": t.ref, "sha": t.sha, "line": t.line} for t in s.tested],
                    "lines": list(s.lines),
                    "port": s.port,
                    "patches": [p.name for p in s.patches],
                }
                for s in catalogue.series
            ],
        },
    )
    return 0
