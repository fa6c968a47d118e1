"""apply_patch / apply_series: what a user sees when porting a patch onto a moved tree."""

from __future__ import annotations

import json
import re

import pytest

from megaport.engine import (
    apply_patch,
    apply_series,
    make_file_diff,
    parse_patch,
    reverse_patch,
)

BASE = "".join(f"line {n}\n" for n in range(1, 21)).encode()


def _edit(content: bytes, old: str, new: str) -> bytes:
    assert old.encode() in content
    return content.replace(old.encode(), new.encode(), 1)


def _patch(path: str, old: bytes | None, new: bytes | None, name: str = "0001-t.patch"):
    return parse_patch(make_file_diff(path, old, new), name)


def _without_index_lines(text: str) -> str:
    """A hand-written or `diff -u` patch has no blob ids; the placer alone must cope."""
    return re.sub(r"(?m)^index .*\n", "", text)


TARGET = _edit(BASE, "line 10\n", "line ten (rocm)\n")
PATCH = _patch("megatron/x.py", BASE, TARGET)


def test_exact_apply_returns_new_bytes_and_exact_outcome() -> None:
    result = apply_patch(PATCH, {"megatron/x.py": BASE}.get)

    assert result.status == "applied"
    assert result.changes == {"megatron/x.py": TARGET}
    (hunk,) = result.hunks
    assert (hunk.outcome, hunk.offset, hunk.fuzz, hunk.line) == ("exact", 0, 0, 7)
    assert hunk.header == "@@ -7,7 +7,7 @@"
    assert hunk.file == "megatron/x.py" and hunk.index == 1


def test_offset_when_upstream_inserted_lines_above() -> None:
    moved = b"import os\nimport sys\n" + BASE

    result = apply_patch(PATCH, {"megatron/x.py": moved}.get)

    assert result.status == "applied"
    assert result.changes["megatron/x.py"] == b"import os\nimport sys\n" + TARGET
    (hunk,) = result.hunks
    assert (hunk.outcome, hunk.offset, hunk.fuzz, hunk.line) == ("offset", 2, 0, 9)
    assert result.max_abs_offset == 2


def test_second_hunk_offset_follows_the_first() -> None:
    target = _edit(_edit(BASE, "line 3\n", "line three\n"), "line 17\n", "line seventeen\n")
    patch = _patch("f", BASE, target)
    moved = _edit(BASE, "line 10\n", "line 10\nextra a\nextra b\n")

    result = apply_patch(patch, {"f": moved}.get)

    assert result.status == "applied"
    assert [(h.outcome, h.offset) for h in result.hunks] == [("exact", 0), ("offset", 2)]
    assert result.changes["f"] == _edit(target, "line 10\n", "line 10\nextra a\nextra b\n")


def test_fuzz_one_when_first_context_line_changed_upstream() -> None:
    drifted = _edit(BASE, "line 7\n", "line 7 # edited upstream\n")

    refused = apply_patch(PATCH, {"megatron/x.py": drifted}.get)
    result = apply_patch(PATCH, {"megatron/x.py": drifted}.get, max_fuzz=1)

    assert refused.status == "failed"
    assert result.status == "applied"
    assert result.changes["megatron/x.py"] == _edit(TARGET, "line 7\n", "line 7 # edited upstream\n")
    (hunk,) = result.hunks
    assert (hunk.outcome, hunk.fuzz, hunk.offset, hunk.line) == ("fuzz", 1, 0, 7)
    assert result.max_fuzz == 1


def test_fuzz_two_when_first_and_last_two_context_lines_changed() -> None:
    drifted = BASE
    for n in (7, 8, 12, 13):
        drifted = _edit(drifted, f"line {n}\n", f"line {n} (upstream)\n")

    assert apply_patch(PATCH, {"megatron/x.py": drifted}.get, max_fuzz=1).status == "failed"
    result = apply_patch(PATCH, {"megatron/x.py": drifted}.get, max_fuzz=2)

    assert result.status == "applied"
    assert result.changes["megatron/x.py"] == _edit(drifted, "line 10\n", "line ten (rocm)\n")
    assert [(h.outcome, h.fuzz) for h in result.hunks] == [("fuzz", 2)]


def test_fuzz_refused_reports_nearest_line_and_similarity() -> None:
    drifted = _edit(BASE, "line 8\n", "line 8 # upstream\n")

    result = apply_patch(PATCH, {"megatron/x.py": drifted}.get, max_fuzz=0)

    assert result.status == "failed"
    assert result.changes == {}
    (hunk,) = result.failed_hunks
    assert hunk.outcome == "failed" and hunk.line is None
    assert hunk.nearest_line == 7
    assert hunk.similarity is not None and 0.8 < hunk.similarity < 1.0


def test_changed_line_itself_changed_upstream_fails_even_with_fuzz() -> None:
    drifted = _edit(BASE, "line 10\n", "line 10 (upstream rewrote it)\n")
    result = apply_patch(PATCH, {"megatron/x.py": drifted}.get, max_fuzz=3)
    assert result.status == "failed"
    assert result.failed_hunks[0].nearest_line == 7


def test_every_hunk_and_file_is_reported_not_just_the_first_failure() -> None:
    a_new = _edit(_edit(BASE, "line 2\n", "two\n"), "line 18\n", "eighteen\n")
    text = make_file_diff("a.py", BASE, a_new) + make_file_diff("b.py", BASE, TARGET)
    patch = parse_patch(text, "0003-two-files.patch")
    tree = {"a.py": _edit(BASE, "line 2\n", "line 2 upstream\n"), "b.py": BASE}

    result = apply_patch(patch, tree.get)

    assert result.status == "failed"
    assert [(h.file, h.index, h.outcome) for h in result.hunks] == [
        ("a.py", 1, "failed"),
        ("a.py", 2, "exact"),
        ("b.py", 1, "exact"),
    ]
    assert result.changes == {}


def test_without_nearest_search_every_outcome_is_the_same_and_no_nearest_is_given() -> None:
    """drift ranks series on outcomes alone (find_nearest=False): the same outcomes, no search."""
    a_new = _edit(_edit(BASE, "line 2\n", "two\n"), "line 18\n", "eighteen\n")
    text = make_file_diff("a.py", BASE, a_new) + make_file_diff("b.py", BASE, TARGET)
    patch = parse_patch(text, "0003-two-files.patch")
    tree = {"a.py": _edit(BASE, "line 2\n", "line 2 upstream\n"), "b.py": BASE}

    full = apply_patch(patch, tree.get, max_fuzz=0)
    ranked = apply_patch(patch, tree.get, max_fuzz=0, find_nearest=False)

    assert ranked.status == full.status == "failed"
    assert [(h.file, h.index, h.outcome, h.line) for h in ranked.hunks] == [
        (h.file, h.index, h.outcome, h.line) for h in full.hunks
    ]
    assert full.failed_hunks[0].nearest_line is not None
    assert ranked.failed_hunks[0].nearest_line is None and ranked.failed_hunks[0].similarity is None


def test_already_applied_is_detected_and_changes_nothing() -> None:
    result = apply_patch(PATCH, {"megatron/x.py": TARGET}.get)

    assert result.status == "already-applied"
    assert result.changes == {}
    assert result.failed_hunks == ()
    assert result.files[0].hunks[0].header == PATCH.files[0].hunks[0].header


def test_already_applied_without_index_lines_and_after_upstream_moved() -> None:
    patch = parse_patch(_without_index_lines(make_file_diff("f", BASE, TARGET)), "p")
    moved = b"header\n" + TARGET
    result = apply_patch(patch, {"f": moved}.get)
    assert result.status == "already-applied"
    assert result.files[0].hunks[0].offset == 1


def test_blob_ids_tell_applied_from_unapplied_in_repetitive_text() -> None:
    # Adding a duplicate line: the forward hunk also matches the patched file.
    old = b"pass\npass\n"
    new = b"pass\npass\npass\n"
    patch = _patch("f", old, new)

    assert apply_patch(patch, {"f": new}.get).status == "already-applied"
    assert apply_patch(patch, {"f": old}.get).changes == {"f": new}


def test_create_delete_and_rename() -> None:
    text = (
        make_file_diff("new.py", None, b"print('hi')\n")
        + make_file_diff("gone.py", b"bye\n", None)
        + "diff --git a/old_name.py b/new_name.py\n"
        "similarity index 90%\n"
        "rename from old_name.py\n"
        "rename to new_name.py\n"
        "--- a/old_name.py\n"
        "+++ b/new_name.py\n"
        "@@ -1,2 +1,2 @@\n"
        " keep\n"
        "-cuda\n"
        "+rocm\n"
    )
    patch = parse_patch(text, "0004-files.patch")
    tree = {"gone.py": b"bye\n", "old_name.py": b"keep\ncuda\n"}

    result = apply_patch(patch, tree.get)

    assert result.status == "applied"
    assert result.changes == {
        "new.py": b"print('hi')\n",
        "gone.py": None,
        "old_name.py": None,
        "new_name.py": b"keep\nrocm\n",
    }
    assert [(f.path, f.old_path, f.action) for f in result.files] == [
        ("new.py", None, "create"),
        ("gone.py", None, "delete"),
        ("new_name.py", "old_name.py", "rename"),
    ]
    after = {"new.py": b"print('hi')\n", "new_name.py": b"keep\nrocm\n"}
    assert apply_patch(patch, after.get).status == "already-applied"


def test_pure_rename_without_hunks_moves_content() -> None:
    text = (
        "diff --git a/a.py b/b.py\n"
        "similarity index 100%\n"
        "rename from a.py\n"
        "rename to b.py\n"
    )
    patch = parse_patch(text, "r.patch")
    assert apply_patch(patch, {"a.py": b"x\n"}.get).changes == {"a.py": None, "b.py": b"x\n"}
    assert apply_patch(patch, {"b.py": b"x\n"}.get).status == "already-applied"


def test_create_over_existing_file_fails_unless_same_content() -> None:
    patch = _patch("new.py", None, b"content\n")

    same = apply_patch(patch, {"new.py": b"content\n"}.get)
    different = apply_patch(patch, {"new.py": b"other\n"}.get)

    assert same.status == "already-applied"
    assert different.status == "failed"
    assert different.files[0].error == "file already exists"


def test_empty_new_file_is_created_and_then_already_applied() -> None:
    patch = _patch("empty.txt", None, b"")
    assert apply_patch(patch, {}.get).changes == {"empty.txt": b""}
    assert apply_patch(patch, {"empty.txt": b""}.get).status == "already-applied"
    assert apply_patch(patch, {"empty.txt": b"x"}.get).status == "failed"


def test_delete_needs_matching_content_and_missing_file_means_applied() -> None:
    patch = _patch("gone.py", b"a\nb\n", None)

    assert apply_patch(patch, {"gone.py": b"a\nb\n"}.get).changes == {"gone.py": None}
    assert apply_patch(patch, {}.get).status == "already-applied"
    grown = apply_patch(patch, {"gone.py": b"a\nb\nc\n"}.get)
    assert grown.status == "failed"
    assert grown.files[0].error == "file content differs from what the patch deletes"


def test_modify_missing_file_fails_with_file_error() -> None:
    result = apply_patch(PATCH, {}.get)
    assert result.status == "failed"
    assert result.files[0].error == "file does not exist"
    assert [h.outcome for h in result.hunks] == ["failed"]


def test_crlf_file_keeps_crlf_when_patch_is_lf() -> None:
    crlf_base = BASE.replace(b"\n", b"\r\n")

    result = apply_patch(PATCH, {"megatron/x.py": crlf_base}.get)

    assert result.status == "applied"
    assert result.changes["megatron/x.py"] == TARGET.replace(b"\n", b"\r\n")


def test_crlf_patch_on_crlf_file_is_exact() -> None:
    crlf_base, crlf_target = BASE.replace(b"\n", b"\r\n"), TARGET.replace(b"\n", b"\r\n")
    patch = _patch("w.bat", crlf_base, crlf_target)
    assert "\r\n" in make_file_diff("w.bat", crlf_base, crlf_target)

    result = apply_patch(patch, {"w.bat": crlf_base}.get)

    assert result.changes == {"w.bat": crlf_target}
    assert result.hunks[0].outcome == "exact"


def test_mixed_endings_outside_the_hunk_survive() -> None:
    mixed = BASE.replace(b"line 1\n", b"line 1\r\n").replace(b"line 20\n", b"line 20\r\n")
    result = apply_patch(PATCH, {"megatron/x.py": mixed}.get)
    assert result.changes["megatron/x.py"] == _edit(mixed, "line 10\n", "line ten (rocm)\n")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param(b"a\nb", b"a\nb\n", id="add-final-newline"),
        pytest.param(b"a\nb\n", b"a\nb", id="remove-final-newline"),
        pytest.param(b"a\nb", b"a\nc", id="change-unterminated-last-line"),
        pytest.param(b"a\nb", b"a\nb\nc", id="append-after-unterminated"),
        pytest.param(b"x", b"", id="empty-out-unterminated"),
        pytest.param(b"", b"x", id="fill-empty-file-unterminated"),
    ],
)
def test_final_newline_changes_round_trip(old: bytes, new: bytes) -> None:
    patch = _patch("f", old, new)
    assert apply_patch(patch, {"f": old}.get).changes == {"f": new}
    assert apply_patch(patch, {"f": new}.get).status == "already-applied"
    assert apply_patch(reverse_patch(patch), {"f": new}.get).changes == {"f": old}


def test_no_newline_hunk_does_not_match_a_terminated_line() -> None:
    patch = parse_patch(_without_index_lines(make_file_diff("f", b"a\nb", b"a\nB")), "p")
    result = apply_patch(patch, {"f": b"a\nb\n"}.get)
    assert result.status == "failed"


def test_reverse_patch_swaps_sides_and_file_order() -> None:
    patch = parse_patch(
        make_file_diff("a", None, b"x\n") + make_file_diff("b", b"y\n", b"z\n"), "p"
    )
    reverse = reverse_patch(patch)
    assert [(f.action, f.path) for f in reverse.files] == [("modify", "b"), ("delete", "a")]
    assert reverse.files[0].hunks[0].lines == (("+", "y"), ("-", "z"))
    assert reverse.files[1].old_blob == patch.files[0].new_blob
    assert reverse_patch(reverse) == patch


def test_series_chains_contents_and_stops_at_first_failure() -> None:
    step1 = _edit(BASE, "line 5\n", "line five\n")
    step2 = _edit(step1, "line five\n", "line 5 v2\n")
    unrelated = _edit(BASE, "line 15\n", "fifteen\n")
    p1 = _patch("f", BASE, step1, "0001.patch")
    p2 = _patch("f", step1, step2, "0002.patch")
    broken = _patch("f", b"nothing like it\n", b"x\n", "0003.patch")
    p4 = _patch("f", BASE, unrelated, "0004.patch")

    results = apply_series([p1, p2, broken, p4], {"f": BASE}.get)

    assert [(r.name, r.status) for r in results] == [
        ("0001.patch", "applied"),
        ("0002.patch", "applied"),
        ("0003.patch", "failed"),
    ]
    assert results[1].changes == {"f": step2}


def test_series_rerun_on_patched_tree_is_all_already_applied() -> None:
    step1 = _edit(BASE, "line 5\n", "line five\n")
    step2 = _edit(step1, "line 12\n", "line twelve\n")
    patches = [_patch("f", BASE, step1, "0001.patch"), _patch("f", step1, step2, "0002.patch")]
    results = apply_series(patches, {"f": step2}.get)
    assert [r.status for r in results] == ["already-applied", "already-applied"]


def test_to_dict_is_json_ready_and_describes_failures() -> None:
    drifted = _edit(BASE, "line 8\n", "line 8 # upstream\n")
    result = apply_patch(PATCH, {"megatron/x.py": drifted}.get)

    data = json.loads(json.dumps(result.to_dict()))

    assert data["status"] == "failed"
    (hunk,) = data["files"][0]["hunks"]
    assert hunk["file"] == "megatron/x.py"
    assert hunk["outcome"] == "failed"
    assert (hunk["offset"], hunk["fuzz"], hunk["line"]) == (0, 0, None)
    assert hunk["nearest_line"] == 7
    assert 0.8 < hunk["similarity"] < 1.0

    applied = apply_patch(PATCH, {"megatron/x.py": BASE}.get).to_dict()
    assert applied["changes"] == {"megatron/x.py": "write"}
    assert "nearest_line" not in applied["files"][0]["hunks"][0]


def test_negative_fuzz_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        apply_patch(PATCH, {}.get, max_fuzz=-1)
