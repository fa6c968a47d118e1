"""Write a one-series catalogue for a test: the folder, its patches, the list file, catalogue.toml."""

from __future__ import annotations

from pathlib import Path

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
