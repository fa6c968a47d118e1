"""Property tests: diff random texts, parse, apply; the engine must reproduce the target
exactly (bytes), undo it with the reverse patch, and recognise it as already applied."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaport.engine import apply_patch, make_file_diff, parse_patch, reverse_patch

PATH = "pkg/mod.py"

# Few distinct short lines, so texts repeat lines the way real code repeats blank lines,
# "pass" and closing brackets: the hard case for placement.
line_text = st.sampled_from(["", "a", "b", "c", "pass", "x = 1", "  y", "}"])


@st.composite
def file_contents(draw) -> bytes:
    lines = draw(st.lists(line_text, max_size=30))
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    final_newline = draw(st.booleans())
    text = ending.join(lines)
    if lines and final_newline:
        text += ending
    return text.encode()


def _read(content: bytes):
    return {PATH: content}.get


PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(old=file_contents(), new=file_contents())
def test_diff_then_apply_gives_target_bytes(old: bytes, new: bytes) -> None:
    text = make_file_diff(PATH, old, new)
    if old == new:
        assert text == ""
        return
    result = apply_patch(parse_patch(text, "p.patch"), _read(old))
    assert result.status == "applied"
    assert result.changes == {PATH: new}
    assert all(h.outcome == "exact" for h in result.hunks)


@PROPERTY_SETTINGS
@given(old=file_contents(), new=file_contents())
def test_reverse_patch_restores_source_bytes(old: bytes, new: bytes) -> None:
    if old == new:
        return
    patch = parse_patch(make_file_diff(PATH, old, new), "p.patch")
    result = apply_patch(reverse_patch(patch), _read(new))
    assert result.status == "applied"
    assert result.changes == {PATH: old}


@PROPERTY_SETTINGS
@given(old=file_contents(), new=file_contents())
def test_patch_on_its_own_result_is_already_applied(old: bytes, new: bytes) -> None:
    if old == new:
        return
    patch = parse_patch(make_file_diff(PATH, old, new), "p.patch")
    result = apply_patch(patch, _read(new))
    assert result.status == "already-applied"
    assert result.changes == {}


@st.composite
def lf_texts(draw) -> tuple[bytes, bytes]:
    """An LF file with at least one line break, and an edited LF version of it."""
    old_lines = draw(st.lists(line_text, min_size=1, max_size=25))
    new_lines = draw(st.lists(line_text, max_size=25))
    old = "\n".join(old_lines) + ("\n" if draw(st.booleans()) else "")
    new = "\n".join(new_lines) + ("\n" if new_lines and draw(st.booleans()) else "")
    if "\n" not in old:
        old += "\n"
    return old.encode(), new.encode()


@PROPERTY_SETTINGS
@given(texts=lf_texts())
def test_lf_patch_on_crlf_checkout_gives_crlf_target(texts: tuple[bytes, bytes]) -> None:
    old, new = texts
    if old == new:
        return
    patch = parse_patch(make_file_diff(PATH, old, new), "p.patch")
    crlf_old, crlf_new = old.replace(b"\n", b"\r\n"), new.replace(b"\n", b"\r\n")
    result = apply_patch(patch, _read(crlf_old))
    assert result.status == "applied"
    assert result.changes == {PATH: crlf_new}


optional_contents = st.one_of(st.none(), file_contents())


@PROPERTY_SETTINGS
@given(old=optional_contents, new=optional_contents)
def test_create_and_delete_round_trip(old: bytes | None, new: bytes | None) -> None:
    if old == new:
        return
    patch = parse_patch(make_file_diff(PATH, old, new), "p.patch")
    before = {} if old is None else {PATH: old}
    after = {} if new is None else {PATH: new}
    assert apply_patch(patch, before.get).changes == {PATH: new}
    assert apply_patch(patch, after.get).status == "already-applied"
    assert apply_patch(reverse_patch(patch), after.get).changes == {PATH: old}
