"""Paths named by a patch must stay inside the tree and out of .git."""

from __future__ import annotations

import pytest

from megaport.engine import UnsafePathError, check_patch_paths, is_within, parse_patch
from megaport.errors import MegaportError


def _patch_touching(path: str, *, rename_from: str | None = None):
    if rename_from is not None:
        text = (
            f"diff --git a/{rename_from} b/{path}\n"
            "similarity index 100%\n"
            f"rename from {rename_from}\n"
            f"rename to {path}\n"
        )
    else:
        text = f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n"
    return parse_patch(text, "0005-evil.patch")


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "a/../../b",
        "megatron/../../etc/passwd",
        ".git/config",
        ".git",
        "sub/.git/hooks/post-checkout",
        ".GIT/config",
        "dir\\..\\x",
    ],
)
def test_unsafe_paths_are_refused_with_the_patch_name(path: str) -> None:
    with pytest.raises(UnsafePathError) as caught:
        check_patch_paths(_patch_touching(path))
    message = str(caught.value)
    assert message.startswith("0005-evil.patch: refusing unsafe path ")
    assert "(absolute paths, '..' and .git/ are not allowed)" in message
    assert isinstance(caught.value, MegaportError)


def test_absolute_path_is_refused() -> None:
    # "+++ /etc/passwd" has no b/ prefix to strip, so the path stays absolute.
    patch = parse_patch("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "abs.patch")
    assert patch.files[0].path == "/etc/passwd"
    with pytest.raises(UnsafePathError, match="'/etc/passwd'"):
        check_patch_paths(patch)


def test_control_characters_from_quoted_names_are_refused() -> None:
    text = '--- "a/tab\\there"\n+++ "b/tab\\there"\n@@ -1 +1 @@\n-a\n+b\n'
    patch = parse_patch(text, "q.patch")
    assert patch.files[0].path == "tab\there"
    with pytest.raises(UnsafePathError):
        check_patch_paths(patch)


def test_rename_source_is_checked_too() -> None:
    with pytest.raises(UnsafePathError, match=r"'\.\./outside\.py'"):
        check_patch_paths(_patch_touching("inside.py", rename_from="../outside.py"))


@pytest.mark.parametrize(
    "path", ["megatron/core/x.py", "a.py", ".github/workflows/ci.yml", "dir/.gitignore", "x..y"]
)
def test_ordinary_paths_pass(path: str) -> None:
    check_patch_paths(_patch_touching(path))


def test_is_within_is_lexical() -> None:
    assert is_within("/repo", "megatron/x.py")
    assert is_within("/repo", "a/./b/../c")
    assert is_within("/repo/", "x")
    assert not is_within("/repo", "../repo-evil/x")
    assert not is_within("/repo", "a/../../x")
    assert not is_within("/repo", "/etc/passwd")
    assert is_within("/repo", "/repo/inside")
    assert not is_within("/repo", "/repository")
