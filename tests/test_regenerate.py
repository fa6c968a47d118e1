"""`megaport regenerate`: the catalogue's one copy of the replacement package follows the one source."""

from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner
from support.catalogues import write_catalogue

from megaport import replacements
from megaport.catalogue import PORT_DIR, builtin_patches_dir, load_catalogue
from megaport.cli import main
from megaport.engine import apply_series, parse_patch
from megaport.regenerate import new_file_section, regenerate, replacement_patch, upstream_range
from megaport.replacements import TREE_PATH, render


def copy_catalogue(tmp_path):
    target = tmp_path / "patches"
    shutil.copytree(builtin_patches_dir(), target)
    return target


def applied(patch_files) -> dict[str, bytes]:
    """The files a list of patches leaves on an empty tree (None: deleted, left out)."""
    files: dict = {}
    for result in apply_series([parse_patch(p.text(), name=p.name) for p in patch_files], lambda path: None):
        assert result.status == "applied", result
        files.update(result.changes)
    return {path: content for path, content in files.items() if content is not None}


def snapshot(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_stale_copy_is_detected_and_regenerated_deterministically(tmp_path):
    patches = copy_catalogue(tmp_path)
    owner = replacement_patch(load_catalogue(patches).get("core-0.13-0.16"))
    assert owner.parent.parent.name == PORT_DIR  # the package lives once, in a shared patch
    original = owner.read_bytes()
    owner.write_bytes(original.replace(b"+FULLY_MASKED_ROWS_ARE_ZERO = True", b"+FULLY_MASKED_ROWS_ARE_ZERO = False"))

    check = CliRunner().invoke(main, ["regenerate", "--check", "--patches", str(patches)])
    assert check.exit_code == 1 and "differs from the source" in check.output

    assert CliRunner().invoke(main, ["regenerate", "--patches", str(patches)]).exit_code == 0
    assert owner.read_bytes() == original
    before = snapshot(patches)
    assert not any(r.changed for r in regenerate(load_catalogue(patches), write=True))
    assert snapshot(patches) == before


def test_each_series_gets_its_era_rendering_and_own_patches_their_range():
    """The shared patches, applied alone, give exactly the package rendered for the series' era and path."""
    for series in load_catalogue().series:
        shared = [p for p in series.patches if p.port]
        assert shared and series.patches[: len(shared)] == tuple(shared), series.name
        files = applied(shared)
        rendered = render(fully_masked_rows_are_zero=series.fully_masked_rows == "zero", tree_path=series.replacement,
                          transformer_engine_imports_guarded=series.transformer_engine_imports_guarded)
        assert files == {path: text.encode() for path, text in rendered.items()}, series.name
        guarded = "TRANSFORMER_ENGINE_IMPORTS_GUARDED = True" in rendered[f"{series.replacement}/era.py"]
        # Upstream imported TE layers unguarded from 2023-07 until 2024-07 (E4, E5 and E6's first weeks).
        assert guarded == (series.era not in ("E4", "E5") and series.name not in ("e6-2024-06", "e6-2024-07-05")), series.name
        for patch in series.patches:
            assert (f"Upstream-Range: {upstream_range(series)}\n" in patch.text()) == (patch.port is None)


def test_one_change_to_the_source_rewrites_only_the_shared_port_patches(tmp_path, monkeypatch):
    patches = copy_catalogue(tmp_path)
    before = snapshot(patches)
    source = tmp_path / "rocm_port"
    shutil.copytree(replacements._SOURCE, source, ignore=shutil.ignore_patterns("__pycache__"))
    last = replacements.module_files()[-1]  # its section ends the base patch
    (source / last).write_text(replacements.source_text(last) + "# one more line\n", encoding="utf-8")
    monkeypatch.setattr(replacements, "_SOURCE", source)

    check = CliRunner().invoke(main, ["regenerate", "--check", "--patches", str(patches)])
    assert check.exit_code == 1
    assert CliRunner().invoke(main, ["regenerate", "--patches", str(patches)]).exit_code == 0
    after = snapshot(patches)
    changed = sorted(str(path) for path in after if after[path] != before.get(path))
    assert changed and all(path.startswith(f"{PORT_DIR}/") for path in changed), changed
    assert len(changed) <= len(load_catalogue(patches).ports)  # the base, and the variants' index lines
    base = next(p for p in changed if p.startswith(f"{PORT_DIR}/base/"))
    assert (patches / base).read_text().endswith("+# one more line\n")


def test_regenerate_writes_a_missing_port_folder_that_check_reports(tmp_path):
    patches = copy_catalogue(tmp_path)
    before = snapshot(patches)
    shutil.rmtree(patches / PORT_DIR / "megatron-zero-guarded")

    check = CliRunner().invoke(main, ["regenerate", "--check", "--patches", str(patches)])
    assert check.exit_code == 2
    line = check.output.strip()
    assert "\n" not in line and "megatron-zero-guarded" in line and "megaport regenerate" in line

    assert CliRunner().invoke(main, ["regenerate", "--patches", str(patches)]).exit_code == 0
    assert snapshot(patches) == before


def test_a_series_without_a_port_still_carries_the_module_in_its_own_patch(tmp_path):
    """Catalogues of the older layout (no [[port]]: the package in a series' own patch) regenerate
    as before, with the entry's era fields; a module the stale copy lacks is added."""
    stale = ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] Add it\n\n"
             "Because.\n\nUpstream-Range: v1..v2\n\n" + new_file_section("megatron/other.py", b"kept\n").decode()
             + new_file_section(f"{TREE_PATH}/__init__.py", b"stale\n").decode()
             + new_file_section(f"{TREE_PATH}/gone.py", b"stale\n").decode())
    entry = f'era = "t"\nsummary = "d"\nreplacement = "{TREE_PATH}"\nfully_masked_rows = "uniform"\n'
    root = write_catalogue(tmp_path / "cat", {"0001-add.patch": stale}, entry=entry)

    assert CliRunner().invoke(main, ["regenerate", "--patches", str(root)]).exit_code == 0
    (patch,) = load_catalogue(root).get("demo").patches
    rendered = {path: text.encode() for path, text in render(fully_masked_rows_are_zero=False).items()}
    assert applied([patch]) == {"megatron/other.py": b"kept\n", **rendered}
