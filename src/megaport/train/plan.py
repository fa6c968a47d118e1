"""A training run is a declared Family x Layout x Check, planned here, in one place.

verify's parallel matrix and ``bench --train`` read the same plan: a family (what model,
:mod:`megaport.train.families`), a layout (how many ranks and how split,
:mod:`megaport.train.layouts`) and a check (what it is compared with,
:mod:`megaport.train.checks`). What the era lacks is decided here too, from the tree's parser
(:meth:`Layout.present`), and listed with why rather than dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaport.train.checks.spec import Check
from megaport.train.families import registry as families
from megaport.train.families.spec import Family
from megaport.train.layouts.spec import Layout


@dataclass(frozen=True)
class PlannedRun:
    """One run verify trains and the yardstick it is held to."""

    family: Family
    layout: Layout
    check: Check

    @property
    def id(self) -> str:
        return f"{self.family.name}-{self.layout.name}-{self.check.name}"


@dataclass(frozen=True)
class Absent:
    """A family in a layout the tree cannot train, and why (the era's parser, a model without experts)."""

    family: str
    layout: str
    why: str
    #: the check that does not apply, where the layout itself does
    check: str | None = None


def plan(tree: str, layouts: list, checks: list, *, models: list | None = None) -> tuple[list, list]:
    """The runs for ``tree``: each layout with the families it names by default (those the tree has;
    ``models``, family names, in their place where given), each held to every check that applies
    to it. Returns (runs, absent)."""
    present = {f.name: f for f in families.families_for(tree)}
    runs, absent = [], []
    for layout in layouts:
        names = models if models is not None else _default_families(layout, present)
        for name in names:
            family = present.get(name) or families.get(name)
            why = _why_absent(tree, family, layout, name in present)
            if why is not None:
                absent.append(Absent(name, layout.name, why))
                continue
            for check in checks:
                why_not = check.not_for(layout, tree)
                if why_not is None:
                    runs.append(PlannedRun(family, layout, check))
                else:
                    absent.append(Absent(name, layout.name, why_not, check.name))
    return runs, absent


def _default_families(layout: Layout, present: dict) -> list:
    """The families ``layout`` names that the tree has; where it has none of them, the family every
    era has (:data:`~megaport.train.families.registry.EVERY_ERA`), unless the layout splits experts:
    2022's sequence parallelism and distributed optimizer train with GPT before Llama existed."""
    named = [n for n in layout.families if n in present]
    if named or layout.experts or families.EVERY_ERA not in present:
        return named
    return [families.EVERY_ERA]


def _why_absent(tree: str, family: Family, layout: Layout, present: bool) -> str | None:
    """Why ``family`` cannot train in ``layout`` on ``tree``; None where it can. Layouts train
    through the family's own entry point (a megatron-core package has none: its one-rank harness
    is the family's training test)."""
    if not present:
        return "the tree has no such family"
    if not family.has_entry_point(tree):
        return f"the tree has no {family.entry_point} (layouts train through the family's own entry point)"
    return layout.present(tree, family.flags(tree)[0]) or family.layout_refused(tree, layout)
