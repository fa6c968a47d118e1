"""``megaport regenerate``: render the one replacement source into every port variant, and store
once each patch several series carry."""

from __future__ import annotations

from megaport import regenerate as generate
from megaport.catalogue import load_catalogue, load_ports, patches_dir


def regenerate_series(console, *, patches: str | None = None, check: bool = False) -> int:
    """Exit 1 under ``--check`` when a series' copy differs, so CI catches a forgotten regenerate."""
    root = patches_dir(patches)
    # The port variants first: a new [[port]] gets its file before any series list names it.
    results = generate.regenerate_ports(root, load_ports(root), write=not check)
    results += generate.regenerate_series(load_catalogue(root), write=not check)
    stale = [r for r in results if r.changed]
    for result in results:
        if not result.changed:
            word = "up to date"
        elif result.removed:
            word = "[red]is stored once elsewhere or listed by none[/]" if check else "[green]removed[/]"
        else:
            word = "[red]differs from the source[/]" if check else "[green]regenerated[/]"
        console.print(f"{result.series:<24} {result.patch.name}: {word}")
    if check and stale:
        console.print("run 'megaport regenerate' and commit the series")
        return 1
    return 0
