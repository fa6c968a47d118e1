"""Every model family verify and ``bench --train`` know, in one place: adding one adds a module
and a line here, never a branch in the runner."""

from __future__ import annotations

from megaport.errors import MegaportError
from megaport.train.families import bert, deepseek, ds_moe, gpt, llama, llama3, megablocks_moe, mixtral, t5
from megaport.train.families.spec import Family

#: name -> spec, in the order verify runs them (GPT first: its rows predate families)
FAMILIES = {f.name: f for f in (gpt.FAMILY, bert.FAMILY, t5.FAMILY, llama.FAMILY, llama3.FAMILY, mixtral.FAMILY,
                                deepseek.FAMILY, ds_moe.FAMILY, megablocks_moe.FAMILY)}


#: the family every era has (its ``present`` is always true): it trains a layout in the eras that
#: have none of the families the layout names (SP, the distributed optimizer and interleaved
#: pipelines came to Megatron years before Llama did)
EVERY_ERA = gpt.FAMILY.name


def get(name: str) -> Family:
    """The family called ``name``; a one-line error listing the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise MegaportError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}", exit_code=2) from None


def families_for(tree: str) -> list:
    """The families ``tree`` has (each one's ``present`` rule), in registry order."""
    return [f for f in FAMILIES.values() if f.present(tree)]


def select(tree: str, requested: str | None) -> list:
    """The families a run trains: ``requested`` (comma-separated names), each of which must be
    known and present in ``tree``, else all the tree has."""
    if not requested:
        return families_for(tree)
    names = [n.strip() for n in requested.split(",") if n.strip()]
    if not names:
        raise MegaportError("--model names no family; known: " + ", ".join(FAMILIES), exit_code=2)
    chosen = [get(n) for n in dict.fromkeys(names)]
    missing = [f.name for f in chosen if not f.present(tree)]
    if missing:
        raise MegaportError(f"{tree} has no {', '.join(missing)} (it has: "
                            f"{', '.join(f.name for f in families_for(tree)) or 'none'})", exit_code=2)
    return chosen
