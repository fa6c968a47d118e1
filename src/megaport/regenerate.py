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


def rendered_replacement(series: Series) -> bytes:
    return render(fully_masked_rows_are_zero=series.fully_masked_rows == "zero").encode("utf-8")


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
        if not series.replacement:
            continue
        patch = replacement_patch(series)
        before = patch.read_bytes()
        after = replace_section(before, series.replacement, new_file_section(series.replacement, rendered_replacement(series)))
        if write and after != before:
            patch.write_bytes(after)
        results.append(Regeneration(series.name, patch, after != before))
    return results
