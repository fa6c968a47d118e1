"""Keep every series' copy of the replacement module identical to megaport's one source.

The replacement code (softmax functions, apex stand-ins, backend resolution) lives once, in
``megaport/replacements/rocm_port.py``. Each series carries it as a new-file diff. Regenerating
rewrites only that diff section, byte for byte from the rendered source, so running it on
unchanged series changes nothing, and ``--check`` fails when any copy differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from megaport.catalogue import Catalogue, Series
from megaport.errors import MegaportError
from megaport.replacements import render


@dataclass(frozen=True)
class Regeneration:
    series: str
    patch: Path
    changed: bool


def git_blob_id(content: bytes) -> str:
    """The sha1 git gives a blob, for the diff's full-index line."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def new_file_section(path: str, content: bytes) -> bytes:
    """A git-style diff that creates ``path`` with ``content`` (what format-patch --full-index writes)."""
    lines = content.splitlines(keepends=True)
    out = [
        f"diff --git a/{path} b/{path}\n".encode(),
        b"new file mode 100644\n",
        f"index {'0' * 40}..{git_blob_id(content)}\n".encode(),
        b"--- /dev/null\n",
        f"+++ b/{path}\n".encode(),
        f"@@ -0,0 +1{',' + str(len(lines)) if len(lines) != 1 else ''} @@\n".encode(),
    ]
    for line in lines:
        out.append(b"+" + line)
    if lines and not lines[-1].endswith(b"\n"):
        out.append(b"\n\\ No newline at end of file\n")
    return b"".join(out)


def replace_section(patch_text: bytes, path: str, section: bytes) -> bytes:
    """Swap the diff section for ``path`` inside a patch, leaving every other byte alone."""
    header = f"diff --git a/{path} b/{path}\n".encode()
    start = patch_text.find(header)
    if start < 0 or (start > 0 and patch_text[start - 1 : start] != b"\n"):
        raise MegaportError(f"no diff section for {path} in the patch")
    end = patch_text.find(b"\ndiff --git ", start + len(header))
    signature = patch_text.find(b"\n-- \n", start + len(header))
    stops = [i + 1 for i in (end, signature) if i >= 0]
    stop = min(stops) if stops else len(patch_text)
    return patch_text[:start] + section + patch_text[stop:]


TRAILER = b"Upstream-Range: "


def upstream_range(series: Series) -> str:
    """'first..last' of the tested refs; a branch entry carries its date ('main@2026-08-22')."""
    if not series.tested:
        return "untested"
    return f"{series.tested[0].label}..{series.tested[-1].label}"


def with_range_trailer(patch_text: bytes, range_text: str) -> bytes:
    """Set the message's Upstream-Range trailer (the message ends where the diff begins)."""
    starts = [i for i in (patch_text.find(b"\n---\n"), patch_text.find(b"\ndiff --git ")) if i >= 0]
    if not starts:
        raise MegaportError("patch has no diff")
    end = min(starts) + 1
    message = patch_text[:end].rstrip(b"\n").split(b"\n")
    message = [line for line in message if not line.startswith(TRAILER)]
    while message and message[-1] == b"":
        message.pop()
    trailer = TRAILER + range_text.encode()
    return b"\n".join(message) + b"\n\n" + trailer + b"\n\n" + patch_text[end:]


def rendered_replacement(series: Series) -> bytes:
    return render(fully_masked_rows_are_zero=series.fully_masked_rows == "zero",
                  transformer_engine_imports_guarded=series.transformer_engine_imports_guarded,
                  tree_path=series.replacement).encode("utf-8")


def replacement_patch(series: Series) -> Path:
    """The one patch of a series that creates the replacement module."""
    header = f"diff --git a/{series.replacement} b/{series.replacement}\n".encode()
    owners = [p.path for p in series.patches if header in p.path.read_bytes()]
    if len(owners) != 1:
        raise MegaportError(
            f"series {series.name}: expected one patch creating {series.replacement}, found {len(owners)}"
        )
    return owners[0]


def regenerate(catalogue: Catalogue, *, write: bool) -> list[Regeneration]:
    """Render the source into every series; write only when asked (``--check`` does not)."""
    results = []
    for series in catalogue.series:
        owner = replacement_patch(series) if series.replacement else None
        for patch_file in series.patches:
            before = patch_file.path.read_bytes()
            after = with_range_trailer(before, upstream_range(series))
            if patch_file.path == owner:
                section = new_file_section(series.replacement, rendered_replacement(series))
                after = replace_section(after, series.replacement, section)
            if write and after != before:
                patch_file.path.write_bytes(after)
            results.append(Regeneration(series.name, patch_file.path, after != before))
    return results
