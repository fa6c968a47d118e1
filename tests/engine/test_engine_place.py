"""locate/nearest: exact, nearest offset, ordering, fuzz that only drops context, anchors."""

from __future__ import annotations

from megaport.engine import Hunk, locate, nearest
from megaport.engine.place import expected_index


def _lines(*texts: str) -> list[str]:
    return [text + "\n" for text in texts]


def _hunk(*lines: str, start: int = 1) -> Hunk:
    """Hunk from ' a' / '-b' / '+c' strings; header counts computed from the lines."""
    parsed = tuple((line[0], line[1:]) for line in lines)
    old = sum(1 for kind, _ in parsed if kind != "+")
    new = sum(1 for kind, _ in parsed if kind != "-")
    return Hunk(start, old, start, new, "", parsed)


CHANGE_D = _hunk(" b", " c", "-d", "+D", " e", " f", start=2)


def test_exact_position() -> None:
    lines = _lines("a", "b", "c", "d", "e", "f", "g")
    found = locate(lines, CHANGE_D, expected=1, max_fuzz=0)
    assert found is not None
    assert (found.start, found.offset, found.fuzz) == (1, 0, 0)


def test_offset_when_lines_were_inserted_above() -> None:
    lines = _lines("new1", "new2", "new3", "a", "b", "c", "d", "e", "f", "g")
    found = locate(lines, CHANGE_D, expected=1, max_fuzz=0)
    assert found is not None
    assert (found.start, found.offset, found.fuzz) == (4, 3, 0)


def test_nearest_of_two_occurrences_wins() -> None:
    block = ["b", "c", "d", "e", "f"]
    lines = _lines(*(block + ["x"] * 10 + block + ["y"] * 2))
    found = locate(lines, CHANGE_D, expected=14, max_fuzz=0)
    assert found is not None and found.start == 15
    found = locate(lines, CHANGE_D, expected=3, max_fuzz=0)
    assert found is not None and found.start == 0


def test_search_from_keeps_hunks_in_order() -> None:
    block = ["b", "c", "d", "e", "f"]
    lines = _lines(*(block + ["x"] * 3 + block))
    found = locate(lines, CHANGE_D, expected=0, max_fuzz=0, search_from=5)
    assert found is not None and found.start == 8


def test_max_offset_zero_only_accepts_the_expected_line() -> None:
    lines = _lines("new", "a", "b", "c", "d", "e", "f")
    assert locate(lines, CHANGE_D, expected=1, max_fuzz=0, max_offset=0) is None
    assert locate(lines, CHANGE_D, expected=2, max_fuzz=0, max_offset=0) is not None


def test_fuzz_one_drops_a_changed_first_context_line() -> None:
    lines = _lines("a", "B-changed", "c", "d", "e", "f", "g")
    assert locate(lines, CHANGE_D, expected=1, max_fuzz=0) is None
    found = locate(lines, CHANGE_D, expected=1, max_fuzz=1)
    assert found is not None
    assert (found.start, found.fuzz, found.trim_head, found.trim_tail, found.offset) == (
        2,
        1,
        1,
        0,
        0,
    )


def test_fuzz_two_drops_two_leading_and_trailing_context_lines() -> None:
    lines = _lines("a", "B", "C", "d", "E", "F", "g")
    assert locate(lines, CHANGE_D, expected=1, max_fuzz=1) is None
    found = locate(lines, CHANGE_D, expected=1, max_fuzz=2)
    assert found is not None
    assert (found.start, found.fuzz, found.trim_head, found.trim_tail) == (3, 2, 2, 2)


def test_fuzz_never_drops_changed_lines() -> None:
    lines = _lines("a", "b", "c", "not-d", "e", "f", "g")
    assert locate(lines, CHANGE_D, expected=1, max_fuzz=3) is None


def test_hunk_starting_at_line_one_only_matches_at_the_start() -> None:
    hunk = _hunk(" a", "-b", "+B", " c", " d", " e", start=1)
    assert locate(_lines("a", "b", "c", "d", "e"), hunk, 0, 0) is not None
    shifted = _lines("x", "a", "b", "c", "d", "e")
    assert locate(shifted, hunk, 0, 0) is None
    found = locate(shifted, hunk, 0, 1)
    assert found is not None and (found.fuzz, found.trim_head) == (1, 1)


def test_hunk_without_trailing_context_only_matches_at_the_end() -> None:
    hunk = _hunk(" a", " b", " c", "+tail", start=2)
    assert locate(_lines("x", "a", "b", "c", "more"), hunk, 1, 0) is None
    found = locate(_lines("top", "x", "a", "b", "c"), hunk, 1, 0)
    assert found is not None and (found.start, found.offset) == (2, 1)


def test_hunk_at_line_one_without_trailing_context_must_be_the_whole_file() -> None:
    hunk = _hunk(" a", " b", "+tail", start=1)
    assert locate(_lines("a", "b"), hunk, 0, 0) is not None
    assert locate(_lines("a", "b", "c"), hunk, 0, 0) is None


def test_uneven_context_in_mid_file_is_not_an_anchor() -> None:
    # Series trim context where upstream releases differ; that must not pin the hunk.
    hunk = _hunk(" c", "-d", "+D", " e", " f", " g", start=3)
    found = locate(_lines("new", "a", "b", "c", "d", "e", "f", "g", "h"), hunk, 2, 0)
    assert found is not None and (found.start, found.offset) == (3, 1)


def test_no_newline_hunk_matches_only_an_unterminated_last_line() -> None:
    hunk = Hunk(1, 1, 1, 1, "", (("-", "x"), ("+", "y")), old_no_newline=True)
    assert locate(["x\n"], hunk, 0, 0) is None
    assert locate(["x"], hunk, 0, 0) is not None


def test_expected_index_of_insertion_and_replacement_hunks() -> None:
    assert expected_index(Hunk(5, 0, 6, 2, "", (("+", "a"), ("+", "b")))) == 5
    assert expected_index(Hunk(5, 3, 5, 3, "", ())) == 4
    assert expected_index(Hunk(0, 0, 1, 1, "", (("+", "a"),))) == 0


def test_nearest_reports_the_most_similar_window() -> None:
    hunk = _hunk(" def forward(self, x):", "-    return self.fc(x)", "+    return self.fc2(x)")
    lines = _lines(
        "import torch",
        "",
        "class M:",
        "    def forward(self, inputs):",
        "        return self.fc(inputs)",
        "",
    )
    line, similarity = nearest(lines, hunk, expected=0)
    assert line == 4
    assert 0.7 < similarity < 1.0


def test_nearest_on_unrelated_text_is_not_similar() -> None:
    line, similarity = nearest(_lines("zzz", "yyy"), CHANGE_D, expected=1)
    assert line in (1, 2)
    assert similarity < 0.3
