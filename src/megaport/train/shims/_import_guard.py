"""What a shim that guards one unguarded import line needs: where the unported tree has the line,
the module's source with the line replaced, and the source fix that installs it. One place for the
shims of that shape (``te-cross-entropy-import``, ``te-projector-import``, and
``deprecated-decorator-import``, whose line moves rather than guards), each keeping its own
constants and its own reason."""

from __future__ import annotations

from megaport.train.hooks import source_fix
from megaport.train.tree_files import tree_says


def import_guard(module: str, file: str, broken: str, guarded: str):
    """``(applies, guarded_import, install)`` for a shim that replaces ``broken`` (a module-level
    import line, newline-delimited so an indented guarded copy is not matched) with ``guarded`` in
    ``module``'s source (``file`` in the tree) before the module runs."""

    def applies(tree: str) -> bool:
        """Whether the unported ``tree``'s module has the unguarded line."""
        return tree_says(tree, file, broken)

    def guarded_import(source: str) -> str:
        return source.replace(broken, guarded, 1)

    def install() -> None:
        source_fix(module, guarded_import)

    return applies, guarded_import, install
