"""Baseline shims against upstream's real history (full clones): the kernel-masked-rows shim's own
rule, read from each tested commit's kernel source, agrees with the catalogue's fully-masked-row
semantics for every series (written apart, they must still say the same of every era)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megaport.catalogue import load_catalogue
from megaport.train.shims import kernel_masked_rows, registry


def _export_headers(clone: Path, sha: str, dest: Path) -> str:
    for rel in kernel_masked_rows._KERNEL_HEADER:
        shown = subprocess.run(["git", "--git-dir", str(clone / ".git") if (clone / ".git").exists() else str(clone),
                                "show", f"{sha}:{rel}"], capture_output=True, text=True)
        if shown.returncode == 0:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(shown.stdout)
    return str(dest)


@pytest.mark.parametrize("fork", [False, True], ids=["upstream", "megatron-deepspeed"])
def test_the_shims_rule_agrees_with_each_series_fully_masked_rows(request, tmp_path, fork):
    clone = request.getfixturevalue("deepspeed_clone" if fork else "full_clone")
    checked = 0
    for series in load_catalogue(None).series:
        if series.is_upstream == fork or not series.tested:
            continue
        for tested in series.tested:
            tree = _export_headers(clone, tested.sha, tmp_path / tested.sha)
            assert registry.applies("kernel-masked-rows", tree) == (series.fully_masked_rows == "zero"), \
                (series.name, tested.ref, tested.sha)
            checked += 1
    assert checked
