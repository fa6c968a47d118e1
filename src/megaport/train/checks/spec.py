"""What a check is: given a planned run (a family in a layout on a tree), train what it needs and
say how the run compares with its yardstick. One spec; each check its own module beside this one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megaport.train.parity import loss_change


@dataclass(frozen=True)
class Context:
    """What a check needs to run: the tree, its unported commit, the device, an environment for the
    ported tree's processes, and a folder for what the checks of one session share (checkpoints)."""

    tree: str
    upstream_sha: str | None
    gpu: bool
    env: dict
    workdir: str


@dataclass(frozen=True)
class Check:
    """One yardstick a training run is held to."""

    name: str
    #: one line for people: what is compared with what
    summary: str
    #: (context, family name, layout) -> the comparison: a dict with at least ``problems`` (empty
    #: when the check holds), ``against`` and the figures the report shows
    compare: Callable
    #: why the check does not apply to a layout on a tree, or None where it does: (layout, tree) -> str | None
    not_for: Callable = lambda layout, tree: None
    #: the comparison's figures in a few words, for the report: compared -> str
    figures: Callable = lambda compared: loss_figures(compared)


def loss_figures(compared: dict) -> str:
    """Two runs' largest loss (and grad norm) difference, over how many iterations, and how much
    the loss fell."""
    norms = (f", grad norm {compared['grad_norm_max_relative_difference']:.1e}"
             if compared.get("grad_norm_compared") else "")
    scale = compared.get("grad_norm_scale")
    norms += f" (the layout's divided by {scale['factor']}: the era's own scaling)" if scale else ""
    within = compared.get("tolerance")
    norms += f" (tolerance {within['loss']:.0e}: {within['why']})" if within else ""
    return (f"loss {compared['max_relative_difference']:.1e}{norms} over {len(compared['iterations'])}, "
            + loss_change(compared["loss_drop"]))
