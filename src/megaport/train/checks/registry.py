"""Every check a planned run can be held to, one module each; adding one adds a line here."""

from __future__ import annotations

from megaport.errors import MegaportError
from megaport.train.checks import cross_load, layout_change, one_rank, resume, tp_replicas, upstream_parity

#: name -> check, in the order a planned run's checks run
CHECKS = {c.name: c for c in (one_rank.CHECK, upstream_parity.CHECK, tp_replicas.CHECK, resume.CHECK, layout_change.CHECK,
                                     cross_load.CHECK)}


def select(requested: str | None) -> list:
    """The checks named in ``requested`` (comma-separated), else all."""
    if not requested:
        return list(CHECKS.values())
    try:
        return [CHECKS[n.strip()] for n in dict.fromkeys(requested.split(",")) if n.strip()]
    except KeyError as exc:
        raise MegaportError(f"unknown check {exc.args[0]!r}; known: {', '.join(CHECKS)}", exit_code=2) from None
