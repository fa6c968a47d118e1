"""Refuse patch paths that could write outside the tree or into git's own metadata.

Patches come from files anyone can edit; a path such as ``../../etc/profile`` or
``.git/hooks/post-checkout`` must never reach the file system. Symlinks inside the tree are
the file-system layer's job (it can see them); this module only judges the strings.
"""

from __future__ import annotations

import posixpath

from .errors import UnsafePathError
from .model import Patch


def check_patch_paths(patch: Patch) -> None:
    """Raise :class:`UnsafePathError` for the first unsafe path the patch names."""
    label = patch.name or "<patch>"
    for file in patch.files:
        for path in (file.old_path, file.new_path):
            if path is not None and unsafe_reason(path) is not None:
                raise UnsafePathError(
                    f"{label}: refusing unsafe path {path!r} "
                    "(absolute paths, '..' and .git/ are not allowed)"
                )


def unsafe_reason(path: str) -> str | None:
    """Why ``path`` is unsafe, or None when it is a plain relative path inside the tree."""
    if path == "" or path.strip() == "":
        return "empty path"
    if path.startswith("/"):
        return "absolute path"
    if "\\" in path:
        return "backslash in path"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in path):
        return "control character in path"
    components = path.split("/")
    if ".." in components:
        return "'..' component"
    if any(component.lower() == ".git" for component in components):
        return "inside .git"
    if posixpath.normpath(path) in (".", ""):
        return "names the tree root"
    return None


def is_within(root: str, path: str) -> bool:
    """True when ``path`` (relative to ``root``, or absolute) stays inside ``root`` after
    normalising ``.``/``..`` lexically (no file-system access, so no symlink resolution)."""
    base = posixpath.normpath(root)
    target = posixpath.normpath(posixpath.join(base, path))
    if base == "/":
        return target.startswith("/")
    return target == base or target.startswith(base + "/")
