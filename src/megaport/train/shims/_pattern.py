"""What a failure must look like for a shim to answer it: the exception's type, and where it was
raised (the raising frame's line of code, or a file on the way), never a log's display text."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    """Every part given must hold for one exception of the failure's chain.

    ``module`` is matched whole against ``ImportError.name`` (the module that was missing);
    ``message`` is searched in the exception's own message; ``code`` in the line of code of the
    frame that raised it; ``file`` in the file of any of its frames."""

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
        if self.code is not None and not (one.frames and re.search(self.code, one.frames[-1].code)):
            return False
        return self.file is None or any(re.search(self.file, f.file) for f in one.frames)
