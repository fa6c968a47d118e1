"""``megaport status``: what a ported tree holds, and whether its patched files changed since."""

from __future__ import annotations

from pathlib import Path

from megaport.catalogue import load_catalogue
from megaport.errors import MegaportError
from megaport.git import changed_files
from megaport.porttree import PortState, read_state
from megaport.report import write_json


def status(tree: Path, console, *, json_file: str | None = None, patches: str | None = None) -> int:
    """Offline report; exit 0 when the tree is as megaport left it, 1 when patched files changed."""
    tree = tree.expanduser().absolute()
    state = read_state(tree)
    if state is None:
        raise MegaportError(f"{tree} is not a megaport tree (no .git/megaport/state.json); run 'megaport apply' first")
    changed = changed_patched_files(tree, state)
    catalogue_note = catalogue_drift(state, patches)
    console.print(f"tree      {tree}")
    console.print(f"upstream  {state.upstream_url} @ {state.upstream_ref} = {state.upstream_sha[:12]}")
    console.print(f"series    {state.series} (branch {state.branch}, made by megaport {state.megaport_version})")
    for record in state.patches:
        commit = record.commit[:12] if record.commit else "-"
        console.print(f"  {record.status:<16} {commit:<12} {record.name}")
    if changed:
        console.print(f"[yellow]{len(changed)} patched file(s) changed since apply:[/]")
        for path in changed:
            console.print(f"  {path}")
    else:
        console.print("[green]patched files unchanged since apply[/]")
    if catalogue_note:
        console.print(f"[yellow]{catalogue_note}[/]")
    write_json(
        json_file,
        {
            "tree": str(tree),
            "upstream": {"url": state.upstream_url, "ref": state.upstream_ref, "sha": state.upstream_sha},
            "series": state.series,
            "branch": state.branch,
            "patches": [record.__dict__ for record in state.patches],
            "changed_files": changed,
            "catalogue": catalogue_note or "matches",
        },
    )
    return 1 if changed else 0


def changed_patched_files(tree: Path, state: PortState) -> list[str]:
    """Patched files that differ from the port's last commit, committed or not."""
    if not state.files:
        return []
    return changed_files(tree, state.head, state.files)


def catalogue_drift(state: PortState, patches: str | None) -> str:
    """Whether the series on disk still matches what was applied (empty when it does)."""
    try:
        series = load_catalogue(patches).get(state.series)
    except MegaportError:
        return f"series {state.series} is not in the current catalogue"
    now = [(p.name, p.sha256()) for p in series.patches]
    then = [(p.name, p.sha256) for p in state.patches]
    if now != then:
        return f"series {state.series} changed since this tree was ported; re-run apply into a new --dest to update"
    return ""
