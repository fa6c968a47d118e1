"""parse_patch on real git output (format-patch mails, git diff, diff -u) and broken input."""

from __future__ import annotations

import pytest

from megaport.engine import PatchFormatError, parse_patch
from megaport.errors import MegaportError

# Made by `git format-patch -1 -M` on a commit touching six files (CRLF, delete, modify,
# create, final-newline change, rename with edit). '\r' is written explicitly.
FORMAT_PATCH = (
    "From d8e49db51b8fb1ac74a9834a890a079f4e9e1aea Mon Sep 17 00:00:00 2001\n"
    "From: =?UTF-8?q?J=C3=B6rg=20Dev?= <a@b.c>\n"
    "Date: Sun, 22 Nov 2026 08:32:04 +0000\n"
    "Subject: [PATCH 2/7] rocm: port all the things and keep a subject that is\n"
    " long enough to be folded\n"
    "\n"
    "Longer explanation of why.\n"
    "Second line.\n"
    "---\n"
    " crlf.txt               | 2 +-\n"
    " gone.py                | 2 --\n"
    " 6 files changed, 6 insertions(+), 6 deletions(-)\n"
    " rename moved.py => renamed.py (83%)\n"
    "\n"
    "diff --git a/crlf.txt b/crlf.txt\n"
    "index b4ec4d1..c6d393e 100644\n"
    "--- a/crlf.txt\n"
    "+++ b/crlf.txt\n"
    "@@ -1,3 +1,3 @@\n"
    " alpha\r\n"
    "-beta\r\n"
    "+BETA\r\n"
    " gamma\r\n"
    "diff --git a/gone.py b/gone.py\n"
    "deleted file mode 100644\n"
    "index 5e59029..0000000\n"
    "--- a/gone.py\n"
    "+++ /dev/null\n"
    "@@ -1,2 +0,0 @@\n"
    "-old content\n"
    "-more\n"
    "diff --git a/mod.py b/mod.py\n"
    "index f62562a..b0feca7 100644\n"
    "--- a/mod.py\n"
    "+++ b/mod.py\n"
    "@@ -1,7 +1,7 @@ def section():\n"
    " line1\n"
    " line2\n"
    " line3\n"
    "-line4\n"
    "+LINE4\n"
    " line5\n"
    " line6\n"
    " line7\n"
    "diff --git a/new.py b/new.py\n"
    "new file mode 100644\n"
    "index 0000000..d5a09df\n"
    "--- /dev/null\n"
    "+++ b/new.py\n"
    "@@ -0,0 +1 @@\n"
    "+brand new\n"
    "diff --git a/nonl.txt b/nonl.txt\n"
    "index 20cbb4d..85d29fa 100644\n"
    "--- a/nonl.txt\n"
    "+++ b/nonl.txt\n"
    "@@ -1 +1,2 @@\n"
    "-no newline\n"
    "\\ No newline at end of file\n"
    "+no newline\n"
    "+now has\n"
    "diff --git a/moved.py b/renamed.py\n"
    "similarity index 83%\n"
    "rename from moved.py\n"
    "rename to renamed.py\n"
    "index 6d974a3..f3d3ff6 100644\n"
    "--- a/moved.py\n"
    "+++ b/renamed.py\n"
    "@@ -1,6 +1,6 @@\n"
    " x\n"
    " y\n"
    "-z\n"
    "+Z\n"
    " w\n"
    " v\n"
    " u\n"
    "-- \n"
    "2.39.5\n"
    "\n"
)

# `git format-patch --no-stat` of a commit with an empty body: no '---' line at all.
HUNKLESS_PATCH = (
    "From b28296d32107e123e5b22c796e5d422d96a94712 Mon Sep 17 00:00:00 2001\n"
    "From: Dev <a@b.c>\n"
    "Date: Sun, 22 Nov 2026 08:32:06 +0000\n"
    "Subject: [PATCH] [rocm] pure rename, empty file, mode\n"
    "\n"
    "\n"
    "diff --git a/empty.txt b/empty.txt\n"
    "new file mode 100644\n"
    "index 0000000..e69de29\n"
    "diff --git a/mod.py b/mod.py\n"
    "old mode 100644\n"
    "new mode 100755\n"
    "diff --git a/new.py b/newer.py\n"
    "similarity index 100%\n"
    "rename from new.py\n"
    "rename to newer.py\n"
    "-- \n"
    "2.39.5\n"
    "\n"
)

PLAIN_GIT_DIFF = (
    "diff --git a/mod.py b/mod.py\n"
    "index f62562a..b0feca7 100644\n"
    "--- a/mod.py\n"
    "+++ b/mod.py\n"
    "@@ -3,3 +3,3 @@\n"
    " line3\n"
    "-line4\n"
    "+LINE4\n"
    " line5\n"
)


def test_format_patch_mail_header_gives_subject_message_author_date() -> None:
    patch = parse_patch(FORMAT_PATCH, "0002-rocm-port.patch")

    assert patch.name == "0002-rocm-port.patch"
    assert patch.subject == (
        "rocm: port all the things and keep a subject that is long enough to be folded"
    )
    assert patch.message == "Longer explanation of why.\nSecond line."
    assert patch.author == "Jörg Dev <a@b.c>"
    assert patch.date == "Sun, 22 Nov 2026 08:32:04 +0000"


def test_format_patch_files_actions_paths_and_blobs() -> None:
    files = parse_patch(FORMAT_PATCH, "p").files

    assert [(f.action, f.old_path, f.new_path) for f in files] == [
        ("modify", "crlf.txt", "crlf.txt"),
        ("delete", "gone.py", None),
        ("modify", "mod.py", "mod.py"),
        ("create", None, "new.py"),
        ("modify", "nonl.txt", "nonl.txt"),
        ("rename", "moved.py", "renamed.py"),
    ]
    assert [f.path for f in files][1] == "gone.py"
    assert (files[0].old_blob, files[0].new_blob) == ("b4ec4d1", "c6d393e")
    assert files[1].old_mode == "100644" and files[1].is_deleted
    assert files[3].new_mode == "100644" and files[3].is_new
    assert files[5].is_rename


def test_patch_line_points_at_each_diff_git_line() -> None:
    lines = FORMAT_PATCH.split("\n")
    for file in parse_patch(FORMAT_PATCH, "p").files:
        assert lines[file.patch_line - 1].startswith("diff --git ")
        assert file.path in lines[file.patch_line - 1]


def test_hunk_lines_keep_carriage_returns_and_section() -> None:
    files = parse_patch(FORMAT_PATCH, "p").files
    crlf_hunk = files[0].hunks[0]
    assert crlf_hunk.lines == (
        (" ", "alpha\r"),
        ("-", "beta\r"),
        ("+", "BETA\r"),
        (" ", "gamma\r"),
    )
    mod_hunk = files[2].hunks[0]
    assert (mod_hunk.source_start, mod_hunk.source_length) == (1, 7)
    assert (mod_hunk.target_start, mod_hunk.target_length) == (1, 7)
    assert mod_hunk.section == "def section():"
    assert mod_hunk.header == "@@ -1,7 +1,7 @@"


def test_no_newline_marker_sets_the_old_side_flag_only() -> None:
    hunk = parse_patch(FORMAT_PATCH, "p").files[4].hunks[0]
    assert hunk.old_no_newline is True
    assert hunk.new_no_newline is False
    assert hunk.lines == (("-", "no newline"), ("+", "no newline"), ("+", "now has"))


def test_signature_after_last_hunk_is_not_part_of_the_diff() -> None:
    rename = parse_patch(FORMAT_PATCH, "p").files[-1]
    assert rename.hunks[0].lines[-1] == (" ", "u")
    assert len(rename.hunks) == 1


def test_format_patch_base_commit_trailer_is_accepted() -> None:
    text = FORMAT_PATCH.replace(
        "-- \n2.39.5", "\nbase-commit: b28296d32107e123e5b22c796e5d422d96a94712\n-- \n2.39.5"
    )
    assert parse_patch(text, "p").files == parse_patch(FORMAT_PATCH, "p").files


def test_hunkless_files_empty_create_mode_change_pure_rename() -> None:
    patch = parse_patch(HUNKLESS_PATCH, "0003.patch")

    assert patch.subject == "[rocm] pure rename, empty file, mode"
    assert patch.message == ""
    empty, mode, rename = patch.files
    assert (empty.action, empty.new_path, empty.hunks, empty.new_blob) == (
        "create",
        "empty.txt",
        (),
        "e69de29",
    )
    assert (mode.action, mode.old_mode, mode.new_mode, mode.hunks) == (
        "modify",
        "100644",
        "100755",
        (),
    )
    assert (rename.action, rename.old_path, rename.new_path, rename.hunks) == (
        "rename",
        "new.py",
        "newer.py",
        (),
    )


def test_plain_git_diff_has_no_mail_metadata() -> None:
    patch = parse_patch(PLAIN_GIT_DIFF, "local.diff")
    assert (patch.subject, patch.message, patch.author, patch.date) == ("", "", None, None)
    assert patch.files[0].path == "mod.py"
    assert patch.files[0].patch_line == 1


def test_classic_diff_u_with_timestamps_and_dev_null() -> None:
    text = (
        "--- a/src/x.py\t2024-01-01 10:00:00.000000000 +0000\n"
        "+++ b/src/x.py\t2024-01-02 10:00:00.000000000 +0000\n"
        "@@ -1,2 +1,2 @@\n"
        " keep\n"
        "-old\n"
        "+new\n"
        "--- /dev/null\t1970-01-01 00:00:00.000000000 +0000\n"
        "+++ b/src/y.py\t2024-01-02 10:00:00.000000000 +0000\n"
        "@@ -0,0 +1 @@\n"
        "+created\n"
    )
    first, second = parse_patch(text, "classic.diff").files
    assert (first.action, first.path, first.patch_line) == ("modify", "src/x.py", 1)
    assert (second.action, second.path, second.patch_line) == ("create", "src/y.py", 7)


def test_quoted_non_ascii_path_is_unquoted() -> None:
    text = (
        'diff --git "a/caf\\303\\251.txt" "b/caf\\303\\251.txt"\n'
        "new file mode 100644\n"
        "index 0000000..572eb43\n"
        "--- /dev/null\n"
        '+++ "b/caf\\303\\251.txt"\n'
        "@@ -0,0 +1 @@\n"
        "+café\n"
    )
    file = parse_patch(text, "u.patch").files[0]
    assert file.path == "café.txt"
    assert file.hunks[0].lines == (("+", "café"),)


def test_patch_file_with_crlf_everywhere_still_gives_clean_paths() -> None:
    text = PLAIN_GIT_DIFF.replace("\n", "\r\n")
    file = parse_patch(text, "mangled.diff").files[0]
    assert file.path == "mod.py"
    assert file.old_blob == "f62562a"
    assert file.hunks[0].lines[1] == ("-", "line4\r")


def test_blank_context_line_without_leading_space_is_context() -> None:
    text = "--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n\n-b\n+c\n"
    assert parse_patch(text, "p").files[0].hunks[0].lines == (
        (" ", "a"),
        (" ", ""),
        ("-", "b"),
        ("+", "c"),
    )


def _truncated() -> str:
    return FORMAT_PATCH[: FORMAT_PATCH.index(" line7")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", "not a unified diff: no file header found", id="empty"),
        pytest.param("hello\nnot a patch\n", "no file header found", id="garbage"),
        pytest.param("@@ -1 +1 @@\n-a\n+b\n", "no file header found", id="hunk-only"),
        pytest.param(_truncated(), "hunk has fewer lines than its header says", id="truncated"),
        pytest.param(
            FORMAT_PATCH.replace("+LINE4\n", "*LINE4\n"),
            "unexpected line '*LINE4' inside a hunk",
            id="bad-line",
        ),
        pytest.param(
            FORMAT_PATCH.replace("+LINE4\n", "+LINE4\n+extra\n"),
            "hunk has more lines than its header says",
            id="count-too-small",
        ),
        pytest.param(
            PLAIN_GIT_DIFF + " trailing context beyond the count\n",
            "outside any hunk",
            id="extra-context-line",
        ),
        pytest.param(
            "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n+c\n",
            "outside any hunk",
            id="plain-diff-extra-line",
        ),
        pytest.param(
            "diff --git a/x.bin b/x.bin\nindex 1a..2b 100644\n"
            "Binary files a/x.bin and b/x.bin differ\n",
            "binary diff",
            id="binary",
        ),
        pytest.param(
            "diff --git a/x.bin b/x.bin\nindex 1a..2b 100644\nGIT binary patch\nliteral 3\nxyz\n",
            "binary diff",
            id="git-binary",
        ),
        pytest.param(
            "diff --git a/x b/y\nsimilarity index 100%\ncopy from x\ncopy to y\n",
            "copy diffs are not supported",
            id="copy",
        ),
        pytest.param(
            "--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n\\ No newline at end of file\n-b\n+c\n+d\n",
            "in the middle of hunk 1",
            id="misplaced-no-newline-marker",
        ),
    ],
)
def test_invalid_patches_raise_one_line_errors_naming_the_patch(text: str, expected: str) -> None:
    with pytest.raises(PatchFormatError) as caught:
        parse_patch(text, "0002-x.patch")
    message = str(caught.value)
    assert message.startswith("0002-x.patch: ")
    assert expected in message
    assert "\n" not in message
    assert isinstance(caught.value, MegaportError)
    assert caught.value.exit_code == 1


def test_two_concatenated_mails_are_refused() -> None:
    with pytest.raises(PatchFormatError, match="a second patch starts at line"):
        parse_patch(FORMAT_PATCH + HUNKLESS_PATCH, "series.mbox")


def test_error_for_truncated_patch_names_the_file_and_its_line() -> None:
    line = FORMAT_PATCH.split("\n").index("diff --git a/mod.py b/mod.py") + 1
    with pytest.raises(PatchFormatError) as caught:
        parse_patch(_truncated(), "0002-x.patch")
    assert f"in the diff of 'mod.py' (line {line})" in str(caught.value)
