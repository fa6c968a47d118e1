"""Steps run as a module loads, before anyone uses it: for CPU runs and baselines.

``after_import("deepspeed.accelerator.cuda_accelerator", step)`` puts a finder first on
``sys.meta_path``; when the module is imported, the real loader runs it, then each step given for
that module, in the order given (a second step for the same module is added, never dropped).
``before_import`` steps run on the new module before its own code does: for names its module-level
code uses that only exist with a package the machine lacks.
"""

from __future__ import annotations

import importlib.util
import sys


class _ImportSteps:
    def __init__(self, fullname: str):
        self.fullname, self.before, self.after = fullname, [], []

    @property
    def steps(self) -> list:
        return self.before + self.after

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
        real, before, after = spec.loader.exec_module, self.before, self.after

        def exec_module(module):
            for step in before:
                step(module)
            real(module)
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


def forget(fullname: str, step) -> None:
    """Take back ``step`` for ``fullname`` (the CPU substitutions' undo); a finder left without steps goes."""
    for finder in [f for f in sys.meta_path if isinstance(f, _ImportSteps) and f.fullname == fullname]:
        for steps in (finder.before, finder.after):
            if step in steps:
                steps.remove(step)
        if not finder.steps:
            sys.meta_path.remove(finder)
