"""[[port]] variants in a catalogue: how a series names its shared port patches, and the one-line
errors (loading) and problems (lint) when the catalogue, the lists and port/ disagree."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from test_lint import lint, patch_text, problems

from megaport.catalogue import PORT_DIR, load_catalogue, load_ports
from megaport.cli import main
from megaport.portpatches import port_patches
from megaport.regenerate import regenerate_ports

PORT = '[[port]]\nname = "old"\nreplacement = "megatron/rocm_port"\nfully_masked_rows = "uniform"\n'
SERIES = '[[series]]\nname = "demo"\nera = "E1"\nport = "old"\ntested = [{ ref = "v1", sha = "%s" }]\n' % ("a" * 40)


def make(root: Path, *, ports: str = PORT, series: str = SERIES, listing: str | None = None) -> Path:
    """One series taking port variant 'old' (its package moved to megatron/, uniform rows)."""
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "0003-change-two.patch").write_text(patch_text())
    (root / "catalogue.toml").write_text(f"format = 1\n\n{ports}\n{series}")
    regenerate_ports(root, load_ports(root), write=True)
    if listing is None:
        listing = "".join(f"{line}\n" for line in shared_lines(root)) + "0003-change-two.patch\n"
    (root / "demo" / "series").write_text(listing)
    return root


def shared_lines(root: Path) -> list[str]:
    return [p.entry for variant in load_ports(root) for p in port_patches(variant)]


def test_a_series_takes_its_variants_fields_and_shared_patches(tmp_path):
    root = make(tmp_path / "cat")
    series = load_catalogue(root).get("demo")
    assert (series.port, series.replacement, series.fully_masked_rows) == ("old", "megatron/rocm_port", "uniform")
    assert [p.port for p in series.patches] == ["base", "old", None]
    assert series.patches[0].path == root / PORT_DIR / "base" / series.patches[0].name
    result = lint("--patches", str(root))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("change, expected", [
    (lambda r: (r / "demo" / "series").write_text("../port/gone/0002-x.patch\n0003-change-two.patch\n"),
     "series names ../port/gone/0002-x.patch, but catalogue.toml has no [[port]] 'gone'"),
    (lambda r: (r / "demo" / "series").write_text("../port/old/0002-x.patch\n0003-change-two.patch\n"),
     "series names ../port/old/0002-x.patch, which does not exist (run 'megaport regenerate'"),
    (lambda r: (r / "demo" / "series").write_text("../other/0002-x.patch\n"),
     "list entry '../other/0002-x.patch' must be a file in"),
    (lambda r: edit(r, 'port = "old"\n', 'port = "old"\nfully_masked_rows = "zero"\n'),
     "series 'demo': its port 'old' sets fully_masked_rows; remove that from the entry"),
    (lambda r: edit(r, 'port = "old"\n', 'port = "new"\n'),
     "series 'demo': port 'new' is not a [[port]] (known: old)"),
    (lambda r: edit(r, 'name = "old"', 'name = "base"'),
     "[[port]] base is listed twice (or is 'base', the shared folder)"),
])
def test_catalogue_errors_are_one_line(tmp_path, change, expected):
    root = make(tmp_path / "cat")
    change(root)
    result = CliRunner().invoke(main, ["series", "--patches", str(root)])
    assert result.exit_code == 2
    assert expected in result.output and len(result.output.strip().splitlines()) == 1, result.output


def edit(root: Path, old: str, new: str) -> None:
    path = root / "catalogue.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("change, expected", [
    (lambda r: (r / "demo" / "series").write_text(shared_lines(r)[0] + "\n0003-change-two.patch\n"),
     "demo/series:1: must start with port old's shared patches and name no others: ../port/base/"),
    (lambda r: (r / PORT_DIR / "old" / "0003-extra.patch").write_text(patch_text()),
     "port/old/0003-extra.patch: not a shared patch megaport writes for the [[port]] variants; remove it"),
    (lambda r: (r / PORT_DIR / "older").mkdir(),
     "port/older: not a [[port]] variant's folder (nor 'base'); remove it or add the [[port]]"),
    (lambda r: edit(r, "[[series]]", PORT.replace('"old"', '"spare"').replace("uniform", "zero") + "\n[[series]]"),
     "catalogue.toml: [[port]] spare is taken by no series; remove it"),
    (lambda r: edit(r, "[[series]]", PORT.replace('"old"', '"twin"') + "\n[[series]]"),
     "catalogue.toml: [[port]] twin has the settings of [[port]] old; let their series share one"),
    (lambda r: edit(r, 'port = "old"\n', ""),
     "names the shared ../port/base/"),
    (lambda r: add_trailer(r / PORT_DIR / "old"),
     "'Upstream-Range' on a shared port patch, whose series span eras; remove it"),
])
def test_lint_reports_port_problems(tmp_path, change, expected):
    root = make(tmp_path / "cat")
    change(root)
    result = lint("--patches", str(root))
    assert result.exit_code == 1
    assert any(expected in line for line in problems(result)), result.output


def add_trailer(folder: Path) -> None:
    (patch,) = folder.iterdir()
    patch.write_text(patch.read_text().replace("\n\ndiff --git ", "\n\nUpstream-Range: v1..v2\n\ndiff --git ", 1))


def test_lint_names_a_missing_shared_patch_once_and_how_to_write_it(tmp_path):
    root = make(tmp_path / "cat")
    (missing,) = (root / PORT_DIR / "old").iterdir()
    missing.unlink()
    found = problems(lint("--patches", str(root)))
    assert any(line.endswith(f"{missing.name}: missing; run 'megaport regenerate'") for line in found), found
