"""Read any object of the cached repository, for any number of commits, with one git process.

``megaport.git.BlobReader`` reads the files of one commit. A drift check reads the files of
many commits and, for three-way merges, blobs by id (the ``index`` lines of a patch), so this
keeps a single ``git cat-file --batch`` per repository and hands out cheap per-commit views.
Contents are cached by blob id: files that did not change between two refs are read once.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import IO, Optional

from megaport.git import GitError, git_command, git_env, run_git


class ObjectReader:
    """``git cat-file --batch`` on ``repo``; not thread-safe (one per thread)."""

    def __init__(self, repo: str | os.PathLike[str]) -> None:
        self.repo = Path(repo)
        self._blobs: dict[str, bytes] = {}
        self._proc: Optional[subprocess.Popen[bytes]] = subprocess.Popen(
            git_command(["cat-file", "--batch"]),
            cwd=self.repo,
            env=git_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()

    def get(self, name: str) -> Optional[tuple[str, str, bytes]]:
        """``(type, object id, content)`` of the object ``name`` (``<sha>``, ``<commit>:<path>``),
        or None when there is none."""
        proc = self._proc
        if proc is None:
            raise ValueError("ObjectReader is closed")
        assert proc.stdin is not None and proc.stdout is not None
        if "\n" in name:
            raise ValueError(f"unsupported object name: {name!r}")
        try:
            proc.stdin.write(name.encode("utf-8", "surrogateescape") + b"\n")
            proc.stdin.flush()
            header = proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}") from exc
        if not header:
            self.close()
            raise GitError(f"git cat-file stopped while reading {self.repo}")
        line = header.rstrip(b"\n")
        if line.endswith((b" missing", b" ambiguous")):
            return None
        fields = line.split(b" ")
        if len(fields) != 3 or not fields[2].isdigit():
            self.close()
            raise GitError(f"unexpected reply from git cat-file: {header!r}")
        data = _read_exact(proc.stdout, int(fields[2]) + 1)[:-1]
        return fields[1].decode("ascii"), fields[0].decode("ascii"), data

    def blob(self, oid: Optional[str]) -> Optional[bytes]:
        """The blob ``oid`` (full or abbreviated), or None when it is not in the repository."""
        if not oid or set(oid) == {"0"}:
            return None
        if oid in self._blobs:
            return self._blobs[oid]
        found = self.get(oid)
        if found is None or found[0] != "blob":
            return None
        self._blobs[oid] = found[2]
        return found[2]

    def tree(self, commit: str) -> TreeView:
        """The files of ``commit`` (a full sha) as a ``read``/``exists`` tree reader."""
        return TreeView(self, commit)


class TreeView:
    """What planning, recognition and drift need of one commit: file bytes, existence, blob ids."""

    def __init__(self, objects: ObjectReader, commit: str) -> None:
        self.objects = objects
        self.commit = commit
        self._entries: dict[str, Optional[tuple[str, str, bytes]]] = {}

    def _get(self, path: str) -> Optional[tuple[str, str, bytes]]:
        path = _clean(path)
        if path not in self._entries:
            found = self.objects.get(f"{self.commit}:{path}")
            if found is not None and found[0] == "blob":
                self.objects._blobs.setdefault(found[1], found[2])
            self._entries[path] = found
        return self._entries[path]

    def read(self, path: str) -> Optional[bytes]:
        """The exact bytes of the file at ``path``, or None (absent, or a directory)."""
        found = self._get(path)
        return found[2] if found is not None and found[0] == "blob" else None

    def blob_id(self, path: str) -> Optional[str]:
        found = self._get(path)
        return found[1] if found is not None and found[0] == "blob" else None

    def exists(self, path: str) -> bool:
        """True for a file, a directory or a submodule entry."""
        if not _clean(path):
            return True
        if self._get(path) is not None:
            return True
        parent, _, name = _clean(path).rpartition("/")
        found = self._get(parent) if parent else self.objects.get(f"{self.commit}^{{tree}}")
        if found is None or found[0] != "tree":
            return False
        return any(mode == "160000" and entry == name for mode, entry in _tree_entries(found[2], self.commit))

    def is_dir(self, path: str) -> bool:
        found = self._get(path)
        return found is not None and found[0] == "tree"


def list_files(repo: str | os.PathLike[str], commit: str) -> list[str]:
    """Every file path of ``commit``."""
    out = run_git(["ls-tree", "-r", "-z", "--name-only", "--full-tree", commit], repo).stdout
    return [p for p in out.split("\0") if p]


def _clean(path: str) -> str:
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"unsupported path: {path!r}")
    return "/".join(parts)


def _tree_entries(data: bytes, commit: str) -> list[tuple[str, str]]:
    entries = []
    pos, size = 0, len(data)
    hash_len = len(commit) // 2
    while pos < size:
        space = data.index(b" ", pos)
        nul = data.index(b"\0", space)
        entries.append(
            (data[pos:space].decode("ascii"), data[space + 1 : nul].decode("utf-8", "surrogateescape"))
        )
        pos = nul + 1 + hash_len
    return entries


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise GitError("git cat-file stopped in the middle of an object")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
