"""make_file_diff writes what git writes, so its output round-trips through parse/apply."""

from __future__ import annotations

import hashlib

from megaport.engine import apply_patch, make_file_diff, parse_patch
from megaport.engine.blob import git_blob_id


def test_modify_diff_looks_like_git() -> None:
    text = make_file_diff("pkg/m.py", b"a\nb\nc\n", b"a\nB\nc\n")
    assert text == (
        "diff --git a/pkg/m.py b/pkg/m.py\n"
        f"index {git_blob_id(b'a' + bytes([10]) + b'b' + bytes([10]) + b'c' + bytes([10]))}"
        f"..{git_blob_id(b'a' + bytes([10]) + b'B' + bytes([10]) + b'c' + bytes([10]))} 100644\n"
        "--- a/pkg/m.py\n"
        "+++ b/pkg/m.py\n"
        "@@ -1,3 +1,3 @@\n"
        " a\n"
        "-b\n"
        "+B\n"
        " c\n"
    )


def test_blob_ids_are_git_hash_object() -> None:
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert git_blob_id(b"hello\n") == hashlib.sha1(b"blob 6\0hello\n").hexdigest()


def test_new_and_deleted_files_use_dev_null_and_mode_lines() -> None:
    created = make_file_diff("n.py", None, b"x\n")
    assert created.splitlines()[1:5] == [
        "new file mode 100644",
        f"index {'0' * 40}..{git_blob_id(b'x' + bytes([10]))}",
        "--- /dev/null",
        "+++ b/n.py",
    ]
    assert "@@ -0,0 +1 @@" in created
    deleted = make_file_diff("d.py", b"x\ny\n", None)
    assert "deleted file mode 100644" in deleted
    assert "+++ /dev/null" in deleted and "@@ -1,2 +0,0 @@" in deleted


def test_empty_new_file_has_no_hunk() -> None:
    text = make_file_diff("e.txt", None, b"")
    assert text == (
        "diff --git a/e.txt b/e.txt\n"
        "new file mode 100644\n"
        f"index {'0' * 40}..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391\n"
    )


def test_missing_final_newline_gets_git_marker() -> None:
    text = make_file_diff("f", b"a\nb", b"a\nb\n")
    assert "-b\n\\ No newline at end of file\n+b\n" in text


def test_identical_contents_give_no_diff() -> None:
    assert make_file_diff("f", b"same\n", b"same\n") == ""


def test_path_with_space_and_non_ascii_round_trips() -> None:
    for path in ("dir/with space.py", "dir/café.py"):
        patch = parse_patch(make_file_diff(path, b"a\n", b"b\n"), "p")
        assert patch.files[0].path == path
        assert apply_patch(patch, {path: b"a\n"}.get).changes == {path: b"b\n"}


def test_non_utf8_bytes_survive() -> None:
    old, new = b"caf\xe9\n\xff\xfe\n", b"caf\xe9\nchanged\n"
    patch = parse_patch(make_file_diff("latin1.txt", old, new), "p")
    assert apply_patch(patch, {"latin1.txt": old}.get).changes == {"latin1.txt": new}
