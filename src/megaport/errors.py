"""The one exception type users see: a known failure with a message that says what to do."""


class MegaportError(Exception):
    """A failure the user can act on: printed as one line, never as a traceback.

    ``exit_code`` lets a command choose its code (2 for usage/environment by convention).
    """

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
