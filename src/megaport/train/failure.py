"""Why a training process died, as data: the exception's type, message and frames.

The baseline picks its shims by the exception a run died of and the frame that raised it
(:mod:`megaport.train.shims`), never by the display text of a log's tail: torchrun prefixes and
interleaves ranks' output, and a message quoted inside another message would match too. So the
processes megaport starts (the launcher on every rank, the harness) record the exception that
ended them, with its chain, as one JSON file in ``$MEGAPORT_FAILURE_DIR``; the parent reads them.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

FAILURE_DIR_ENV = "MEGAPORT_FAILURE_DIR"


@dataclass(frozen=True)
class Frame:
    """One frame of a traceback: where, and the line of code it was running."""

    file: str
    line: int
    function: str
    code: str


@dataclass(frozen=True)
class Failure:
    """An exception that ended a process, and the exceptions it was raised from (``causes``,
    innermost last): what ``raise ... from`` and ``except: raise`` chains keep."""

    exception: str  # the type's name, e.g. "ModuleNotFoundError"
    message: str
    frames: tuple = ()  # Frame, outermost first: frames[-1] raised it
    module: str | None = None  # ImportError.name: the module that could not be imported
    causes: tuple = field(default=())

    def chain(self) -> list:
        """This failure and every exception it was raised from."""
        return [self, *self.causes]

    def __str__(self) -> str:
        where = f" ({self.frames[-1].file}:{self.frames[-1].line})" if self.frames else ""
        return f"{self.exception}: {self.message}{where}"


def from_exception(exc: BaseException) -> Failure:
    """The failure ``exc`` describes, with its chain of causes (and the ranks' own exceptions a
    distributed checkpoint's error holds: :func:`_rank_failures`)."""
    causes, seen, inner = list(_rank_failures(exc)), {id(exc)}, _cause(exc)
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        causes += [_one(inner), *_rank_failures(inner)]
        inner = _cause(inner)
    head = _one(exc)
    return Failure(head.exception, head.message, head.frames, head.module, tuple(causes))


def _rank_failures(exc: BaseException) -> list:
    """The exceptions ``torch.distributed.checkpoint``'s ``CheckpointException`` keeps per rank in
    ``failures`` (``{rank: (exception, its frames)}``), which its message leaves out: it says
    ``CheckpointException ranks:dict_keys([0])`` and no more (main 2024-08's save, whose cause was
    torch's ``AssertionError: item.index.fqn not in md`` in its global plan)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    out = []
    for value in failures.values():
        inner, frames = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        if not isinstance(inner, BaseException):
            continue
        one = _one(inner)
        if frames:
            one = Failure(one.exception, one.message, _frames(frames), one.module)
        out.append(one)
    return out


def _cause(exc: BaseException):
    return exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _one(exc: BaseException) -> Failure:
    frames = _frames(traceback.extract_tb(exc.__traceback__))
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    return Failure(type(exc).__name__, str(exc), frames, name)


def _frames(summary) -> tuple:
    """A traceback's frames (``traceback.StackSummary``) as :class:`Frame`, outermost first."""
    return tuple(Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary)


def record(exc: BaseException) -> None:
    """Write ``exc`` to ``$MEGAPORT_FAILURE_DIR`` (one file per process) when that is set."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder or isinstance(exc, SystemExit):
        return
    path = Path(folder) / f"failure-{os.getpid()}.json"
    path.write_text(json.dumps({"at": time.time_ns(), **asdict(from_exception(exc))}), encoding="utf-8")


def read(folder) -> list:
    """The failures recorded in ``folder``, the first written first: in a run of several ranks the
    first to fail is the cause, the others die of its closed connections."""
    recorded = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(folder).glob("failure-*.json"))]
    return [_decode(data) for data in sorted(recorded, key=lambda data: data.get("at", 0))]


def _decode(data: dict) -> Failure:
    return Failure(data["exception"], data["message"], tuple(Frame(**f) for f in data["frames"]), data.get("module"),
                   tuple(_decode(c) for c in data.get("causes", ())))


class RunFailed(RuntimeError):
    """A training process failed: the message quotes its log; ``failures`` says what it died of."""

    def __init__(self, message: str, failures: list):
        super().__init__(message)
        self.failures = list(failures)
