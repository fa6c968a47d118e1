"""A drift report for people (text), machines (JSON, JUnit), GitHub (annotations) and summaries
(Markdown). Every format is rendered from the same :class:`DriftReport`; docs/drift.md
documents their shapes."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

from .model import APPLIED, BROKEN, CLEAN, DRIFT, SKIPPED, STATUSES, DriftReport, HunkDrift, PatchDrift, SeriesDrift

FORMATS = ("text", "json", "markdown", "junit", "github")

_STYLES = {
    CLEAN: "green", SKIPPED: "dim", "offset": "yellow", "fuzz": "yellow", APPLIED: "cyan",
    "3way": "magenta", "missing": "bold red", "conflict": "bold red",
}  # fmt: skip


def render(report: DriftReport, fmt: str) -> str:
    """The report as text in ``fmt`` (text is plain, without colours)."""
    if fmt == "json":
        return render_json(report)
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "junit":
        return render_junit(report)
    if fmt == "github":
        return render_github(report)
    if fmt == "text":
        from io import StringIO

        from rich.console import Console

        buffer = StringIO()
        print_text(Console(file=buffer, width=160, highlight=False, no_color=True, soft_wrap=True), report)
        return buffer.getvalue()
    raise ValueError(f"unknown format {fmt!r}")


# --- text -------------------------------------------------------------------------------


def print_text(console, report: DriftReport) -> None:
    """Per (ref, series): one line, then each patch that is not clean with its hunks that are not."""
    from rich.markup import escape

    for result in report.results:
        style = _STYLES.get(result.status, "")
        console.print(
            f"[bold]{escape(result.ref)}[/] ({result.sha[:12]})  [bold]{escape(result.series)}[/]  "
            f"[{style}]{result.status}[/]" + (f"  [dim]{escape(result.reason)}[/]" if result.reason else "")
        )
        if result.refusal:
            console.print(f"    [bold red]apply refuses:[/] {escape(result.refusal)}")
        quiet: dict[str, int] = {}
        for patch in result.patches:
            if patch.status in (CLEAN, SKIPPED):
                quiet[patch.status] = quiet.get(patch.status, 0) + 1
                continue
            pstyle = _STYLES.get(patch.status, "")
            console.print(f"    [{pstyle}]{patch.status:<9}[/] {escape(patch.name)}  [dim]({escape(patch.summary)})[/]")
            for hunk in patch.hunks:
                if hunk.status != CLEAN:
                    console.print(f"              [{_STYLES.get(hunk.status, '')}]{escape(hunk.detail)}[/]")
        if quiet:
            parts = [f"{n} {s}" for s, n in (("clean", quiet.get(CLEAN, 0)), ("skipped", quiet.get(SKIPPED, 0))) if n]
            console.print(f"    [dim]other patches: {', '.join(parts)}[/]")
    console.print(summary_line(report))
    for hint in refresh_hints(report):
        console.print(f"  {escape(hint)}")


def summary_line(report: DriftReport) -> str:
    by_status: dict[str, int] = {}
    for result in report.results:
        by_status[result.status] = by_status.get(result.status, 0) + 1
    parts = ", ".join(f"{by_status[s]} {s}" for s in STATUSES if s in by_status) or "nothing checked"
    refs = len({r.sha for r in report.results})
    verdict = {0: "all clean", 1: "drift that still applies", 2: "conflicts or missing files"}.get(
        report.exit_code, ""
    )
    return f"{len(report.results)} series check(s) on {refs} commit(s): {parts} -> exit {report.exit_code} ({verdict})"


def refresh_hints(report: DriftReport) -> list[str]:
    """The command that refreshes each drifted series on its newest drifted ref (Yocto tells
    users the one command too), and which series need hands."""
    hints: dict[str, str] = {}
    for result in report.results:
        if result.refused_landing:
            hints[f"refused:{result.series}:{result.ref}"] = (
                f"{result.series} lands on {result.ref} only by skipping patches: the tree needs a series of its own"
            )
        elif result.hunk_status in DRIFT:
            hints[f"drift:{result.series}"] = (
                f"refresh: megaport refresh --series {result.series} --ref {result.ref} --as NEW (or --in-place)"
            )
        elif result.hunk_status in BROKEN:
            hints[f"broken:{result.series}:{result.ref}"] = (
                f"{result.series} does not apply to {result.ref}: resolve its conflicting hunks by hand"
            )
    return list(hints.values())


# --- JSON -------------------------------------------------------------------------------


def render_json(report: DriftReport) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


# --- Markdown ---------------------------------------------------------------------------


def render_markdown(report: DriftReport) -> str:
    """A summary table (one row per ref and series) and a table of every hunk that is not clean."""
    out = ["### megaport drift", ""]
    out.append(f"`{_md(report.repo)}`: {_md(summary_line(report))}")
    out.append("")
    out.append("| ref | commit | series | status | clean | offset | fuzz | applied | 3way | missing | conflict |")
    out.append("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for result in report.results:
        counts = result.counts
        cells = [str(counts.get(s, 0)) for s in ("clean", "offset", "fuzz", APPLIED, "3way", "missing", "conflict")]
        out.append(
            f"| `{_md(result.ref)}` | `{result.sha[:12]}` | {_md(result.series)} | {_badge(result.status)} | "
            + " | ".join(cells)
            + " |"
        )
    details = [
        (result, patch, hunk)
        for result in report.results
        for patch in result.patches
        for hunk in patch.hunks
        if hunk.status != CLEAN
    ]
    if details:
        out += ["", "| ref | series | patch | file | hunk | status | detail |", "|---|---|---|---|---|---|---|"]
        for result, patch, hunk in details:
            out.append(
                f"| `{_md(result.ref)}` | {_md(result.series)} | {_md(patch.name)} | `{_md(hunk.file)}` | "
                f"#{hunk.index} | {_badge(hunk.status, hunk.label)} | {_md(_short_detail(hunk))} |"
            )
    hints = refresh_hints(report)
    if hints:
        out += [""] + [f"- `{_md(h)}`" if h.startswith("refresh:") else f"- {_md(h)}" for h in hints]
    return "\n".join(out) + "\n"


def _badge(status: str, label: Optional[str] = None) -> str:
    mark = {CLEAN: "✅", SKIPPED: "⏭️"}.get(status, "⚠️" if status in DRIFT else "❌")
    return f"{mark} {label or status}"


def _short_detail(hunk: HunkDrift) -> str:
    detail = hunk.detail
    prefix = f"{hunk.file} hunk #{hunk.index} {hunk.header}: "
    return detail[len(prefix) :] if detail.startswith(prefix) else detail


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# --- JUnit ------------------------------------------------------------------------------


def render_junit(report: DriftReport) -> str:
    """One testsuite per (ref, series), one testcase per patch: conflict/missing are failures,
    skipped patches are skipped, drift that applies is noted in system-out."""
    suites = ET.Element("testsuites", name="megaport drift")
    total = failures = skipped = 0
    for result in report.results:
        suite = ET.SubElement(suites, "testsuite", name=f"{result.ref} / {result.series}")
        properties = ET.SubElement(suite, "properties")
        for name, value in (("ref", result.ref), ("sha", result.sha), ("series", result.series),
                            ("status", result.status), ("reason", result.reason)):
            ET.SubElement(properties, "property", name=name, value=value)
        if result.refusal:
            ET.SubElement(properties, "property", name="refusal", value=result.refusal)
        suite_failures = suite_skipped = 0
        if result.refused_only:
            case = ET.SubElement(suite, "testcase", classname=f"drift.{result.series}", name="megaport apply")
            ET.SubElement(case, "failure", type="refused", message=result.refusal)
            suite_failures += 1
        for patch in result.patches:
            case = ET.SubElement(suite, "testcase", classname=f"drift.{result.series}", name=patch.name)
            if patch.status in BROKEN:
                suite_failures += 1
                bad = [h for h in patch.hunks if h.status in BROKEN]
                failure = ET.SubElement(case, "failure", type=patch.status, message=bad[0].detail if bad else patch.status)
                failure.text = "\n".join(h.detail for h in bad)
            elif patch.status == SKIPPED:
                suite_skipped += 1
                ET.SubElement(case, "skipped", message=patch.reason)
            out = [f"{patch.status}: {patch.summary}"] + [h.detail for h in patch.hunks if h.status != CLEAN]
            ET.SubElement(case, "system-out").text = "\n".join(out)
        suite.set("tests", str(len(result.patches) + result.refused_only))
        suite.set("failures", str(suite_failures))
        suite.set("errors", "0")
        suite.set("skipped", str(suite_skipped))
        total += len(result.patches) + result.refused_only
        failures += suite_failures
        skipped += suite_skipped
    suites.set("tests", str(total))
    suites.set("failures", str(failures))
    suites.set("errors", "0")
    suites.set("skipped", str(skipped))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


# --- GitHub annotations -----------------------------------------------------------------


def render_github(report: DriftReport, cwd: Optional[Path] = None) -> str:
    """``::warning``/``::error`` workflow commands at the patch file and the hunk's line, one per
    hunk that is not clean, and a ``::notice`` with the summary."""
    lines = []
    for result in report.results:
        if result.refused_only:
            title = f"apply refuses: {result.ref} / {result.series}"
            lines.append(f"::error {_props({'title': title})}::{_escape_data(result.refusal)}")
        for patch in result.patches:
            for hunk in patch.hunks:
                if hunk.status == CLEAN:
                    continue
                level = "error" if hunk.status in BROKEN else "warning"
                props = {"file": _annotation_path(patch, cwd), "title": f"drift {hunk.label}: {result.ref} / {result.series}"}
                line = hunk.patch_line
                if line:
                    props["line"] = str(line)
                message = f"{result.ref} ({result.sha[:12]}): {hunk.detail}"
                lines.append(f"::{level} {_props(props)}::{_escape_data(message)}")
    lines.append(f"::notice title=megaport drift::{_escape_data(summary_line(report))}")
    return "\n".join(lines) + "\n"


def _annotation_path(patch: PatchDrift, cwd: Optional[Path]) -> str:
    """The patch file relative to the working directory (the repository root in CI)."""
    base = (cwd or Path.cwd()).resolve()
    path = patch.path.resolve()
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return os.fspath(path)


def _props(props: dict[str, str]) -> str:
    order = ("file", "line", "title")
    return ",".join(f"{k}={_escape_property(props[k])}" for k in order if k in props)


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def result_label(result: SeriesDrift) -> str:
    return f"{result.ref} / {result.series}"
