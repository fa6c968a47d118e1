"""What the tree's era has: the unported upstream commit decides, never the ported tree.

A patch that dropped a feature from a ported file must make its test fail, not vanish: the
questions "does the era have this module, this name, this file" are asked of the upstream commit
the tree was ported from (:class:`Upstream`), and a name the tree lacks is a failure where upstream
has it (the port lost it) and a skip where upstream lacks it too (an era without it).
"""

from __future__ import annotations

import re
from pathlib import Path

from megaport.smoke._locate import module_path
from megaport.smoke._verdicts import import_first_or_skip

class Upstream:
    """The unported upstream commit a ported tree came from, where the suite decides what an era
    lacks: the commit state.json records (``upstream_sha``), read from the tree's own git (apply
    builds the port's commits on it) without touching the work tree. The ported tree's own files
    never decide an era: a patch that dropped a feature would make its test vanish.

    ``why`` says why the commit cannot be read (no state, the commit missing from the tree's git);
    then :meth:`has` answers None and the caller falls back to the tree, which ``verify --strict``
    counts as a failure.
    """

    def __init__(self, tree: Path, state: dict) -> None:
        self.tree = Path(tree)
        self.sha = str(state.get("upstream_sha") or "")
        self.why: str | None = None
        self._reader = None
        self._texts: dict = {}

    @property
    def label(self) -> str:
        return f"upstream {self.sha[:12]}"

    def _open(self):
        if self._reader is None and self.why is None:
            if not self.sha:
                self.why = "the tree records no upstream commit (.git/megaport/state.json)"
            else:
                from megaport.git import BlobReader, GitError

                try:
                    self._reader = BlobReader(self.tree, self.sha)
                except (GitError, OSError) as exc:
                    self.why = f"upstream commit {self.sha[:12]} cannot be read from the tree's git: {exc}"
        return self._reader

    @property
    def available(self) -> bool:
        return self._open() is not None

    def read(self, path: str) -> str | None:
        """The text of ``path`` at the upstream commit; None when upstream has no such file (or
        cannot be read: see :attr:`available`)."""
        reader = self._open()
        if reader is None:
            return None
        if path not in self._texts:
            data = reader.read(path)
            self._texts[path] = None if data is None else data.decode("utf-8", "replace")
        return self._texts[path]

    def has(self, path: str) -> bool | None:
        """Whether upstream has the file or directory ``path``; None when it cannot be read."""
        reader = self._open()
        return None if reader is None else reader.exists(path)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def names_in(text: str, names) -> list[str]:
    """Those of ``names`` that occur in ``text`` as whole identifiers (defined, imported, bound)."""
    return [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]


def era_name(smoke, module, *names: str):
    """The first of ``names`` that the tree's ``module`` has. When it has none, the unported upstream
    commit decides: its copy of the module names one of them, so the port lost it (a failure); or
    it has none either, an era without it (a skip, with upstream's word for it)."""
    import pytest

    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    wanted = " or ".join(names)
    location = getattr(module, "__file__", None)
    try:
        path = Path(location).resolve().relative_to(smoke.tree.resolve()).as_posix() if location else None
    except ValueError:
        path = None
    upstream = smoke.upstream
    if path is None or upstream is None or not upstream.available:
        why = "its file is not in the tree" if path is None else (upstream.why if upstream else "no upstream")
        pytest.skip(f"{module.__name__} has no {wanted}, and the era cannot be told from upstream ({why})")
    text = upstream.read(path)
    found = names_in(text, names) if text is not None else []
    if found:
        pytest.fail(f"{module.__name__} has no {wanted}, but {upstream.label}'s {path} has {', '.join(found)}: "
                    "the port lost it", pytrace=False)
    pytest.skip(f"{module.__name__} has no {wanted} in this era ("
                + (f"{upstream.label}'s {path} has none either)" if text is not None else f"{upstream.label} has no {path})"))


def era_module(smoke, *names: str):
    """The first of the modules ``names`` that the tree has (eras before 2024 keep the optimizer in
    megatron/optimizer, say). When it has none, upstream decides as in :func:`era_name`: upstream
    has one of them, so the port lost it (a failure), or the era has none (a skip)."""
    import pytest

    module, reason = import_first_or_skip(names, names[0], smoke.tree)
    if module is not None:
        return module
    upstream = smoke.upstream
    if upstream is None or not upstream.available:
        pytest.skip(f"{reason}, and the era cannot be told from upstream "
                    f"({upstream.why if upstream is not None else 'no upstream'})")
    present = [path for name in names for path in module_path(name) if upstream.has(path)]
    if present:
        pytest.fail(f"the ported tree has none of {', '.join(names)} ({reason}), but {upstream.label} has "
                    f"{', '.join(present)}: the port lost it", pytrace=False)
    pytest.skip(f"{reason} ({upstream.label} has none of them either)")
