"""Engine failures, as ``MegaportError`` subclasses so the CLI prints them as one line."""

from __future__ import annotations

from megaport.errors import MegaportError


class PatchFormatError(MegaportError):
    """The patch text cannot be read as a unified diff we know how to apply."""


class UnsafePathError(MegaportError):
    """A patch names a path that could write outside the tree or into ``.git``."""
