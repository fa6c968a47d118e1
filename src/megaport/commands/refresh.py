"""``megaport refresh``: rebuild a series on a new upstream ref (Yocto's devtool/quilt refresh).

Exit codes: 0 refreshed (or, without --as/--in-place, previewed), 2 it cannot be rebuilt
(conflicting hunks or missing files, listed; nothing is written), 3 usage or environment error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaport.catalogue import load_catalogue
from megaport.drift.model import BROKEN, EXIT_BROKEN, EXIT_USAGE
from megaport.git import ObjectReader
from megaport.drift.refresh import (
    DROPPED,
    KEPT,
    conflicts_message,
    rebuild,
    verify,
    write_in_place,
    write_new_series,
)
from megaport.drift.refs import Target
from megaport.drift.run import DriftSession
from megaport.errors import MegaportError
from megaport.store import Store


@dataclass(frozen=True)
class RefreshOptions:
    series: str
    ref: str
    repo: str
    patches: Optional[str] = None
    as_name: Optional[str] = None
    in_place: bool = False


def refresh(options: RefreshOptions, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    if options.as_name and options.in_place:
        raise MegaportError("give --as NEW or --in-place, not both", exit_code=EXIT_USAGE)
    try:
        catalogue = load_catalogue(options.patches)
        series = catalogue.get(options.series)
        store = Store()
        resolved = store.resolve(options.repo, options.ref)
    except MegaportError as exc:
        raise MegaportError(str(exc), exit_code=EXIT_USAGE) from None
    target = Target(options.ref, resolved.sha)
    with ObjectReader(resolved.repo) as objects:
        session = DriftSession(catalogue, objects, store, resolved.url, resolved.repo, [target])
        tree = objects.tree(resolved.sha)
        result = session.check_one(target, tree, series, "refresh")
        console.print(f"series [bold]{escape(series.name)}[/] on {escape(options.ref)} ({resolved.sha[:12]}): {result.status}")
        if result.status in BROKEN:
            for line in conflicts_message(result):
                console.print(f"  [red]{escape(line)}[/]")
            raise MegaportError(
                f"cannot refresh {series.name} on {options.ref}: {len(conflicts_message(result))} hunk(s) conflict "
                "or miss their file (listed above); nothing was written. Fix them by hand in a clone "
                "(git am -3), then export the series again",
                exit_code=EXIT_BROKEN,
            )
        exported = rebuild(session.loaded(series), result)
        verify(series, exported, tree, result)

    table = Table(show_edge=False)
    for column in ("patch", "action", "why"):
        table.add_column(column)
    for patch in exported:
        table.add_row(escape(patch.name), patch.action, escape(patch.note))
    console.print(table)
    unchanged = all(p.action == KEPT for p in exported)
    if options.as_name:
        folder = write_new_series(catalogue, series, exported, options.as_name, options.ref, resolved.sha)
        console.print(f"[green]wrote[/] {folder} and its entry at the end of {catalogue.root / 'catalogue.toml'}")
    elif options.in_place:
        changed = write_in_place(series, exported)
        if changed:
            console.print(f"[green]rewrote[/] {', '.join(changed)} in {series.directory}")
        else:
            console.print(f"{series.name} already matches {options.ref} exactly: nothing to change")
        if not any(t.sha == resolved.sha for t in series.tested):
            console.print(
                f"add {{ ref = \"{options.ref}\", sha = \"{resolved.sha}\" }} to tested of {series.name} in "
                "catalogue.toml once its other tested refs are checked again (megaport drift --series "
                f"{series.name} --ref ...)"
            )
    else:
        verdict = "nothing would change" if unchanged else "would change the patches marked above"
        dropped = [p.name for p in exported if p.action == DROPPED]
        console.print(
            f"preview: {verdict}{'; drops ' + ', '.join(dropped) if dropped else ''}. "
            "Write it with --as NEW (a new series) or --in-place"
        )
    return 0
