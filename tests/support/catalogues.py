"""Write a one-series catalogue for a test: the folder, its patches, the list file, catalogue.toml."""

from __future__ import annotations

import shutil
from pathlib import Path

from megaport.catalogue import COMMON_DIRS, load_catalogue

ROOT = Path(__file__).resolve().parents[2]

DEMO_ENTRY = 'era = "test"\nsummary = "demo"\n'


def write_catalogue(
    root: Path, patches: dict[str, str], *, name: str = "demo", entry: str = DEMO_ENTRY, recognise: str = ""
) -> Path:
    """``entry`` holds the [[series]] lines after the name; ``recognise`` the [series.recognise] body."""
    (root / name).mkdir(parents=True)
    for filename, text in patches.items():
        (root / name / filename).write_text(text)
    (root / name / "series").write_text("".join(f"{n}\n" for n in patches))
    (root / "catalogue.toml").write_text(
        f'format = 1\n\n[[series]]\nname = "{name}"\n{entry}\n[series.recognise]\n{recognise}'
    )
    return root


def copy_shipped(target: Path) -> Path:
    """The shipped catalogue's series (those catalogue.toml names) and the patches they share
    (port/, shared/), in ``target`` (other people's series folders may be in progress beside them)."""
    target.mkdir()
    shutil.copy2(ROOT / "patches" / "catalogue.toml", target / "catalogue.toml")
    for common in COMMON_DIRS:
        shutil.copytree(ROOT / "patches" / common, target / common)
    for series in load_catalogue(ROOT / "patches").series:
        shutil.copytree(series.directory, target / series.name)
    return target
