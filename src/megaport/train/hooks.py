"""One step run right after a module loads, before anyone uses it: for CPU runs and baselines.

``after_import("deepspeed.accelerator.cuda_accelerator", step)`` puts a finder first on
``sys.meta_path``; when the module is imported, the real loader runs it, then each step given for
that module, in the order given (a second step for the same module is added, never dropped).
"""

from __future__ import annotations

import importlib.util
import sys


class _AfterImport:
    def __init__(self, fullname: str, step):
        self.fullname, self.steps = fullname, [step]

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
        real, steps = spec.loader.exec_module, self.steps

        def exec_module(module):
            real(module)
            for step in steps:
                step(module)

        spec.loader.exec_module = exec_module
        return spec


def after_import(fullname: str, step) -> None:
    """Run ``step(module)`` once ``fullname`` has loaded, after the steps given for it before."""
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.fullname == fullname), None)
    if finder is None:
        sys.meta_path.insert(0, _AfterImport(fullname, step))
    elif step not in finder.steps:
        finder.steps.append(step)


def forget(fullname: str, step) -> None:
    """Take back ``step`` for ``fullname`` (the CPU substitutions' undo); a finder left without steps goes."""
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterImport) and f.fullname == fullname]:
        if step in finder.steps:
            finder.steps.remove(step)
        if not finder.steps:
            sys.meta_path.remove(finder)
