"""`megaport regenerate`: series copies of the replacement module follow the one source, exactly."""

from __future__ import annotations

import shutil

from click.testing import CliRunner

from megaport.catalogue import builtin_patches_dir, load_catalogue
from megaport.cli import main
from megaport.regenerate import regenerate, replacement_patch, upstream_range
from megaport.replacements import render


def copy_catalogue(tmp_path):
    target = tmp_path / "patches"
    shutil.copytree(builtin_patches_dir(), target)
    return target


def test_stale_copy_is_detected_and_regenerated_deterministically(tmp_path):
    patches = copy_catalogue(tmp_path)
    series = load_catalogue(patches).series[0]
    owner = replacement_patch(series)
    original = owner.read_bytes()
    owner.write_bytes(original.replace(b"+FULLY_MASKED_ROWS_ARE_ZERO = True", b"+FULLY_MASKED_ROWS_ARE_ZERO = False"))

    check = CliRunner().invoke(main, ["regenerate", "--check", "--patches", str(patches)])
    assert check.exit_code == 1 and "differs from the source" in check.output

    assert CliRunner().invoke(main, ["regenerate", "--patches", str(patches)]).exit_code == 0
    assert owner.read_bytes() == original
    before = {p: p.read_bytes() for p in patches.rglob("*.patch")}
    assert not any(r.changed for r in regenerate(load_catalogue(patches), write=True))
    assert {p: p.read_bytes() for p in patches.rglob("*.patch")} == before


def test_each_series_carries_its_era_rendering_and_range():
    for series in load_catalogue().series:
        text = replacement_patch(series).read_text()
        zero = series.fully_masked_rows == "zero"
        body = "".join(line[1:] + "\n" for line in text.split("\n") if line.startswith("+") and not line.startswith("+++"))
        rendered = render(fully_masked_rows_are_zero=zero, tree_path=series.replacement,
                          transformer_engine_imports_guarded=series.transformer_engine_imports_guarded)
        assert rendered in body
        guarded = "TRANSFORMER_ENGINE_IMPORTS_GUARDED = True" in body
        # Upstream imported TE layers unguarded from 2023-07 until 2024-07 (E4, E5 and E6's first weeks).
        assert guarded == (series.era not in ("E4", "E5") and series.name != "e6-2024-06"), series.name
        for patch in series.patches:
            assert f"Upstream-Range: {upstream_range(series)}\n" in patch.text()
