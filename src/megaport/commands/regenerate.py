"""``megaport regenerate``: render the one replacement source into every series."""

from __future__ import annotations

from megaport.catalogue import load_catalogue
from megaport.regenerate import regenerate


def regenerate_series(console, *, patches: str | None = None, check: bool = False) -> int:
    """Exit 1 under ``--check`` when a series' copy differs, so CI catches a forgotten regenerate."""
    results = regenerate(load_catalogue(patches), write=not check)
    stale = [r for r in results if r.changed]
    for result in results:
        if not result.changed:
            word = "up to date"
        else:
            word = "[red]differs from the source[/]" if check else "[green]regenerated[/]"
        console.print(f"{result.series:<20} {result.patch.name}: {word}")
    if check and stale:
        console.print("run 'megaport regenerate' and commit the series")
        return 1
    return 0
