"""``megaport apply``: clone upstream at a ref, choose the series, and write the ported tree.

Speed matters here (apply should cost little more than a clone, a checkout and ``git am``: see
``benchmarks/apply_vs_git.py``), so the upstream checkout starts in the background as soon as the
ref is resolved, and the catalogue and the heavier modules (patch engine, selection, rich) load
only after that, while git writes files. GitPython is never imported on this path (its import
alone would be a third of apply's own cost on a small tree: see :mod:`megaport.git`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from megaport.catalogue import load_catalogue
from megaport.errors import MegaportError
from megaport.git import BlobReader, is_dirty
from megaport.porttree import (
    PatchRecord,
    PortState,
    Staging,
    branch_name,
    check_symlink_escape,
    commit_plan,
    file_modes,
    move_into_place,
    read_state,
    start_staging,
    switch_to_series,
    write_state,
)
from megaport.store import ResolvedRef, Store

if TYPE_CHECKING:
    from megaport.selection import Choice


@dataclass(frozen=True)
class ApplyOptions:
    ref: str
    repo: str
    dest: Path
    series: str | None = None
    patches: str | None = None
    json_file: str | None = None
    dry_run: bool = False
    max_fuzz: int = 0


def apply(options: ApplyOptions, make_console: Callable) -> int:
    """Port one upstream commit; exit code 0 when DEST holds the ported tree (or a dry run fits)."""
    store = Store()
    resolved = store.resolve(options.repo, options.ref)
    dest = options.dest.expanduser().absolute()
    staging = None if options.dry_run or _in_use(dest) else start_staging(store, resolved, dest)
    upstream = None
    try:
        catalogue = load_catalogue(options.patches)  # while git checks out
        from megaport.report import render_plan

        console = make_console()
        upstream = BlobReader(resolved.repo, resolved.sha)  # upstream's files, read without a checkout
        choice = _choose(options, catalogue, resolved, upstream)
        console.print(f"upstream {resolved.url} @ {options.ref} = {resolved.sha[:12]}")
        console.print(f"series [bold]{choice.series.name}[/] ({choice.series.era}): {choice.reason}")
        render_plan(console, choice.plan, title="dry run" if options.dry_run else "patches")
        if choice.refusal:
            message = f"{choice.refusal}; nothing was written (try another --series, or refresh the series for this ref)"
            _report(options, resolved, choice.plan, choice.reason, "failed", error=message)
            raise MegaportError(message)
        if options.dry_run:
            _report(options, resolved, choice.plan, choice.reason, "planned")
            console.print("dry run: nothing was written")
            return 0
        status = _write_tree(dest, resolved, choice, console, staging, upstream)
        staging = None
    finally:
        if staging is not None:
            staging.discard()
        if upstream is not None:
            upstream.close()
    _report(options, resolved, choice.plan, choice.reason, status)
    return 0


def _choose(options: ApplyOptions, catalogue, resolved: ResolvedRef, tree: BlobReader) -> Choice:
    from megaport.selection import choose_series, forced_choice

    if options.series:
        return forced_choice(catalogue, options.series, tree, max_fuzz=options.max_fuzz)
    try:
        return choose_series(catalogue, tree, max_fuzz=options.max_fuzz)
    except MegaportError as exc:
        _report(options, resolved, None, "", "failed", error=str(exc))
        raise


def _in_use(dest: Path) -> bool:
    """DEST already has content: an earlier port to check, or a tree to refuse."""
    return dest.exists() and not (dest.is_dir() and not any(dest.iterdir()))


def _report(options, resolved, plan, reason, status, error=None) -> None:
    from megaport.report import apply_report, write_json

    write_json(
        options.json_file,
        apply_report(
            url=resolved.url, ref=options.ref, sha=resolved.sha, plan=plan, reason=reason,
            status=status, dest=options.dest, error=error,
        ),
    )


def _write_tree(
    dest: Path, resolved: ResolvedRef, choice: Choice, console, staging: Staging | None, upstream: BlobReader
) -> str:
    """Finish the staged tree and move it to DEST, or confirm an existing identical port."""
    if staging is None:
        if _existing_port_matches(dest, resolved, choice):
            console.print(f"{dest} already holds {choice.series.name} on {resolved.sha[:12]}: nothing to do")
            return "unchanged"
        staging = start_staging(Store(), resolved, dest)
    try:
        plan = choice.plan
        changed = sorted({path for p in plan.patches if p.result for path in p.result.changes})
        check_symlink_escape(upstream, changed)
        modes = file_modes(upstream, changed)
        branch = branch_name(choice.series.name)
        commits = commit_plan(staging.tmp, plan, resolved.sha, branch, modes)
        staging.checkout.wait()
        switch_to_series(staging.tmp, branch)
        head = commits[-1] if commits else resolved.sha
        write_state(staging.tmp, _state(resolved, choice, branch, commits, changed, head))
        move_into_place(staging.tmp, dest)
    except BaseException:
        staging.discard()
        raise
    console.print(f"[green]ported[/] {resolved.sha[:12]} with {choice.series.name} into {dest} (branch {branch})")
    return "applied"


def _existing_port_matches(dest: Path, resolved: ResolvedRef, choice: Choice) -> bool:
    """True for a re-run on the same port; raise for any DEST that must not be touched."""
    if not dest.exists():
        return False
    if dest.is_dir() and not any(dest.iterdir()):
        return False
    state = read_state(dest)
    if state is None:
        raise MegaportError(f"{dest} exists and is not a megaport tree; choose an empty or new --dest", exit_code=2)
    if is_dirty(dest):
        raise MegaportError(
            f"{dest} has uncommitted changes; commit or stash them, or choose another --dest (nothing was changed)",
            exit_code=2,
        )
    hashes = [p.sha256() for p in choice.series.patches]
    same = (
        state.upstream_sha == resolved.sha
        and state.series == choice.series.name
        and [p.sha256 for p in state.patches] == hashes
    )
    if not same:
        raise MegaportError(
            f"{dest} already holds {state.series} on {state.upstream_sha[:12]}; "
            "choose another --dest to port a different ref or series",
            exit_code=2,
        )
    return True


def _state(resolved, choice: Choice, branch: str, commits: list[str], files: list[str], head) -> PortState:
    plan = choice.plan
    by_name = {p.name: p for p in plan.patches}
    commit_iter = iter(commits)
    records = []
    for patch_file in choice.series.patches:
        patch_plan = by_name.get(patch_file.name)
        status = patch_plan.status if patch_plan else "not-run"
        changed = bool(patch_plan and patch_plan.result and patch_plan.result.changes)
        records.append(
            PatchRecord(
                name=patch_file.name,
                sha256=patch_file.sha256(),
                status=status,
                commit=next(commit_iter, None) if changed else None,
            )
        )
    return PortState(
        upstream_url=resolved.url,
        upstream_ref=resolved.ref,
        upstream_sha=resolved.sha,
        series=choice.series.name,
        branch=branch,
        head=head or "",
        patches=records,
        files=files,
    )
