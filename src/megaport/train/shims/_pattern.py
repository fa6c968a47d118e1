"""What a failure must look like for a shim to answer it: the exception's type, and where it was
raised (the raising frame's line of code, or a file on the way), never a log's display text."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Frames between the line that failed and the error that are not the tree's: megaport's own (the CPU
# placement mode sees every torch call on a CPU run) and torch's dispatch.
_PLUMBING = (str(Path(__file__).resolve().parents[2]), f"{os.sep}torch{os.sep}")


def raising_frame(frames):
    """The innermost frame of the tree's own code: where a torch call it made failed."""
    for frame in reversed(frames):
        if not any(part in frame.file for part in _PLUMBING):
            return frame
    return frames[-1] if frames else None


@dataclass(frozen=True)
class Match:
    """Every part given must hold for one exception of the failure's chain.

    ``module`` is matched whole against ``ImportError.name`` (the module that was missing);
    ``message`` is searched in the exception's own message; ``code`` in the line of code of the
    frame that raised it (:func:`raising_frame`); ``file`` in the file of any of its frames."""

    exception: tuple | None  # the exception's type names; None: any type
    module: str | None = None
    message: str | None = None
    code: str | None = None
    file: str | None = None

    def matches(self, failure) -> bool:
        return any(self._holds(one) for one in failure.chain())

    def _holds(self, one) -> bool:
        if self.exception is not None and one.exception not in self.exception:
            return False
        if self.module is not None and not re.fullmatch(self.module, one.module or ""):
            return False
        if self.message is not None and not re.search(self.message, one.message):
            return False
        raising = raising_frame(one.frames)
        if self.code is not None and not (raising and re.search(self.code, raising.code)):
            return False
        return self.file is None or any(re.search(self.file, f.file) for f in one.frames)
