"""Steps run as a module loads, before anyone uses it: for CPU runs and baselines.

``after_import("deepspeed.accelerator.cuda_accelerator", step)`` puts a finder first on
``sys.meta_path``; when the module is imported, the real loader runs it, then each step given for
that module, in the order given (a second step for the same module is added, never dropped).
``before_import`` steps run on the new module before its own code does: for names its module-level
code uses that only exist with a package the machine lacks. ``source_fix`` changes the module's source
before it runs: for a module-level statement of upstream's that fails before any step can reach it.
"""

from __future__ import annotations

import importlib.util
import sys


class _ImportSteps:
    def __init__(self, fullname: str):
        self.fullname, self.before, self.after, self.sources = fullname, [], [], []

    @property
    def steps(self) -> list:
        return self.before + self.after + self.sources

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real, before, after, sources = spec.loader.exec_module, self.before, self.after, self.sources

        def exec_module(module):
            for step in before:
                step(module)
            source = spec.loader.get_source(fullname) if sources and hasattr(spec.loader, "get_source") else None
            if source is None:
                real(module)
            else:
                for fix in sources:
                    source = fix(source)
                exec(compile(source, spec.origin, "exec"), module.__dict__)
            for step in after:
                step(module)

        spec.loader.exec_module = exec_module
        return spec


def _finder(fullname: str) -> _ImportSteps:
    finder = next((f for f in sys.meta_path if isinstance(f, _ImportSteps) and f.fullname == fullname), None)
    if finder is None:
        finder = _ImportSteps(fullname)
        sys.meta_path.insert(0, finder)
    return finder


def after_import(fullname: str, step) -> None:
    """Run ``step(module)`` once ``fullname`` has loaded, after the steps given for it before."""
    steps = _finder(fullname).after
    if step not in steps:
        steps.append(step)


def before_import(fullname: str, step) -> None:
    """Run ``step(module)`` on ``fullname``'s new module before its own code runs."""
    steps = _finder(fullname).before
    if step not in steps:
        steps.append(step)


def source_fix(fullname: str, fix) -> None:
    """Run ``fullname`` from ``fix(its source)`` (a function of the source text) instead of its file as it is."""
    fixes = _finder(fullname).sources
    if fix not in fixes:
        fixes.append(fix)


def forget(fullname: str, step) -> None:
    """Take back ``step`` for ``fullname`` (the CPU substitutions' undo); a finder left without steps goes."""
    for finder in [f for f in sys.meta_path if isinstance(f, _ImportSteps) and f.fullname == fullname]:
        for steps in (finder.before, finder.after, finder.sources):
            if step in steps:
                steps.remove(step)
        if not finder.steps:
            sys.meta_path.remove(finder)
