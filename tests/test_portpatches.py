"""The shared port patches are what `git format-patch` writes for the commits they stand for."""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pytest

from megaport.catalogue import PortVariant, load_catalogue
from megaport.portpatches import BASE, module, port_patches, similarity

FORMAT_PATCH = ["format-patch", "--zero-commit", "--full-index", "--no-signature", "--no-stat", "-N"]


def git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="megaport", GIT_AUTHOR_EMAIL="megaport@localhost",
               GIT_AUTHOR_DATE="Sun, 22 Nov 2026 00:00:00 +0000", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@localhost", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def commit_message(patch: bytes) -> str:
    """Subject (unfolded) and body of a format-patch file: what the commit's message was."""
    head, rest = patch.decode().split("\nSubject: [PATCH] ", 1)
    subject, body = rest.split("\n\n", 1)
    return subject.replace("\n ", " ") + "\n\n" + body[: body.index("\ndiff --git ")]


def format_patch_of(variant: PortVariant, repo: Path) -> list[tuple[str, bytes]]:
    """Make the commits by hand (add the base package; move it and set its constants) and let git
    write them as patches."""
    ours = port_patches(variant)
    git(repo, "init", "-q")
    git(repo, "commit", "-q", "--allow-empty", "-m", "upstream")
    write(repo, module(BASE))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", commit_message(ours[0].data))
    if len(ours) > 1:
        if variant.replacement != BASE.replacement:
            (repo / variant.replacement).parent.mkdir(parents=True, exist_ok=True)
            git(repo, "mv", BASE.replacement, variant.replacement)
        write(repo, module(variant))
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", commit_message(ours[1].data))
    git(repo, *FORMAT_PATCH, "-o", "out", f"HEAD~{len(ours)}")
    return [(p.name, p.read_bytes()) for p in sorted((repo / "out").iterdir())]


def write(repo: Path, files: dict[str, bytes]) -> None:
    for path, content in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(content)


VARIANTS = [
    PortVariant(f"{Path(path).parent.name}-{rows}-{'guarded' if guarded else 'unguarded'}", Path(), path, rows, guarded)
    for path, rows, guarded in itertools.product(
        ("megatron/core/rocm_port", "megatron/rocm_port"), ("zero", "uniform"), (True, False))
]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_port_patches_are_byte_for_byte_git_format_patch(variant, tmp_path):
    ours = [(p.name, p.data) for p in port_patches(variant)]
    assert format_patch_of(variant, tmp_path) == ours


def test_the_shipped_variants_are_among_those_checked():
    shipped = {(v.replacement, v.fully_masked_rows, v.transformer_engine_imports_guarded) for v in load_catalogue().ports}
    assert shipped <= {(v.replacement, v.fully_masked_rows, v.transformer_engine_imports_guarded) for v in VARIANTS}


@pytest.mark.parametrize("old, new", [
    (b"a\n" * 100, b"a\n" * 99 + b"b\n"),
    (b"x" * 300 + b"\n" + b"line\n" * 10, b"y" * 300 + b"\n" + b"line\n" * 10),
    (b"one\r\ntwo\r\n" * 20, b"one\r\ntwo\r\n" * 19 + b"three\r\n"),
    (b"line\n" * 20 + b"end", b"line\n" * 20 + b"END"),
])
def test_similarity_is_gits_rename_score(old, new, tmp_path):
    """The "similarity index" of a rename, as git scores a commit that moves and changes a file."""
    git(tmp_path, "init", "-q")
    (tmp_path / "old").write_bytes(old)
    git(tmp_path, "add", "old")
    git(tmp_path, "commit", "-q", "-m", "old")
    (tmp_path / "old").rename(tmp_path / "moved")
    (tmp_path / "moved").write_bytes(new)
    git(tmp_path, "add", "-A")
    status = git(tmp_path, "diff", "--cached", "-M1%", "--name-status").split()
    assert status == [f"R{similarity(old, new):03d}", "old", "moved"]
