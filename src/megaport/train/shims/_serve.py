"""Modules a shim serves that the interpreter does not have (apex, amp_C, a TransformerEngine stub).

A finder first on ``sys.meta_path`` answers for exactly the names it serves, builds each module
from a function of the shim (real code, importable and testable in megaport), and leaves every
other import alone. ``importlib.util.find_spec`` sees them as upstream's guarded imports do.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class ServedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``modules``: name -> ``fill(module)``; names in ``packages`` are packages."""

    def __init__(self, modules: dict, packages=()):
        self.modules, self.packages = dict(modules), set(packages)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in self.packages)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.modules[module.__name__](module)


def serve(modules: dict, packages=()) -> ServedModules:
    """Put a finder for ``modules`` first on sys.meta_path."""
    finder = ServedModules(modules, packages)
    sys.meta_path.insert(0, finder)
    return finder


def names_from(source) -> callable:
    """A ``fill`` that gives a module the public names of ``source`` (a namespace or module)."""
    def fill(module):
        for name, value in vars(source).items():
            if not name.startswith("__"):
                setattr(module, name, value)
    return fill


def language_models_through(module, adapt) -> None:
    """``module.get_language_model`` (the fork's model modules import it by name) builds language
    models passed through ``adapt(language_model)``: how the fork's MoE-loss shims reach the
    language model T5Model and BertModel build."""
    build = module.get_language_model

    def get_language_model(*args, **kwargs):
        language_model, key = build(*args, **kwargs)
        return adapt(language_model), key

    module.get_language_model = get_language_model
