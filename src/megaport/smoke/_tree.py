"""Finding things in a ported tree of any era, and the guard against apex and the CUDA extensions.

Harness code: it locates the tree's own modules (megatron.core.fusions.fused_softmax, or
megatron/model/fused_softmax.py in old eras; megatron/core/rocm_port.py or megatron/rocm_port.py)
and never supplies an implementation of its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import traceback
from pathlib import Path

from megaport.replacements import port_constant

try:
    import pytest

    # Where conftest keeps the run's settings (a Smoke object) on the pytest config.
    SMOKE_KEY = pytest.StashKey()
except ImportError:  # the bench worker uses this module without pytest
    SMOKE_KEY = None

# What the port must keep out of the process: apex, amp_C and every fused "*_cuda" extension,
# as the port itself lists them.
BLOCKED_EXACT = port_constant("_BLOCKED_EXACT")
BLOCKED_SUFFIX = port_constant("_BLOCKED_SUFFIX")
# Stand-ins put first on sys.path: a real install of any of these is shadowed by a module that
# raises when imported, so an import that gets past the port's blocker fails loudly.
STAND_INS = (
    "apex", "amp_C", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
    "scaled_softmax_cuda", "generic_scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda",
    "fused_layer_norm_cuda", "fused_mix_prec_layer_norm_cuda", "fused_dense_cuda",
)
STAND_IN_MARK = "megaport verify stand-in"

FUSED_SOFTMAX_MODULES = (
    "megatron.core.fusions.fused_softmax",   # core_v0.4 and later
    "megatron.legacy.model.fused_softmax",   # core_v0.6 to 0.16, legacy models
    "megatron.model.fused_softmax",          # before megatron/core/fusions
)
ROCM_PORT_MODULES = ("megatron.core.rocm_port", "megatron.rocm_port")
MASK_FUNC_MODULES = ("megatron.core.transformer.utils", "megatron.legacy.model.utils", "megatron.model.utils")
# The tensor-parallel layers (megatron.core's from 2022-11, megatron.mpu's before), in the order
# the suite imports them.
TP_LAYERS = ("megatron/core/tensor_parallel/layers.py", "megatron/mpu/layers.py")


def module_path(name: str) -> tuple[str, str]:
    """'megatron.core.optimizer' → ('megatron/core/optimizer.py', 'megatron/core/optimizer/__init__.py')."""
    base = name.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


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


def is_blocked(name: str) -> bool:
    top = name.partition(".")[0]
    return top in BLOCKED_EXACT or top.endswith(BLOCKED_SUFFIX)


def blocked_modules_loaded() -> list[str]:
    return sorted(name for name, module in list(sys.modules.items()) if module is not None and is_blocked(name))


def write_stand_ins(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in STAND_INS:
        package = folder / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(
            f"raise RuntimeError({STAND_IN_MARK + ': ' + name + ' was imported; the ported tree must never load it'!r})\n",
            encoding="utf-8",
        )
    return folder


def module_name(path: str) -> str | None:
    """'megatron/core/fusions/fused_softmax.py' → 'megatron.core.fusions.fused_softmax'."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def import_first(names):
    """The first of ``names`` that the tree has; (None, reasons) when none imports."""
    reasons = []
    for name in names:
        try:
            return importlib.import_module(name), None
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                reasons.append(f"{name}: not in this tree")
                continue
            raise
    return None, "; ".join(reasons)


def port_name(rocm_port, name: str):
    """``rocm_port.<name>``, or a failure: rocm_port.py is rendered the same for every era (but two
    era constants), so a name missing from it is a broken port, never an era without it."""
    import pytest

    value = getattr(rocm_port, name, None)
    if value is None:
        pytest.fail(f"{rocm_port.__name__} has no {name}: rocm_port.py is the same in every era, so the port "
                    f"is broken ({getattr(rocm_port, '__file__', '?')})", pytrace=False)
    return value


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


def is_under(module, tree: Path) -> bool:
    location = getattr(module, "__file__", None)
    return location is not None and is_under_path(Path(location), tree)


def is_under_path(path: Path, tree: Path) -> bool:
    try:
        path.resolve().relative_to(tree.resolve())
        return True
    except ValueError:
        return False


def tree_frame(exc: BaseException, tree: Path) -> str:
    """'megatron/core/x.py:12: import apex' for the innermost frame of the tree in a traceback."""
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            rel = Path(frame.filename).resolve().relative_to(tree.resolve())
        except (ValueError, OSError):
            continue
        if rel.name == "rocm_port.py" and frame.name == "find_spec":
            continue  # the blocker refusing: the importing line is the frame before it
        found = f"{rel}:{frame.lineno}: {(frame.line or '').strip()}"
    return found


# The stack a ported tree must run on (Python 3.12, torch >= 2.6, NumPy 2): an API of these that
# old upstream code needs but today's release removed (torch._six, np.float, ...) is the port's to
# fix, never a dependency the user lacks.
TARGET_STACK = ("torch", "numpy")
# Imported by upstream at module level without a guard in some eras; ROCm has no
# TransformerEngine, so such an import is the port's to guard.
PORT_GUARDS = ("transformer_engine",)


def missing_import_verdict(missing: str) -> tuple[str, str]:
    """('fail' | 'skip', why) for an import of ``missing`` that failed while importing tree code.

    A skip is only for an optional dependency that is genuinely not installed; a name removed from
    an installed package of the target stack, or an unguarded TransformerEngine import, fails.
    """
    top = missing.partition(".")[0]
    if top in PORT_GUARDS:
        return "fail", (f"imports {top} without a guard: ROCm has no TransformerEngine, so the port "
                        "must guard this import")
    installed = top == "" or importlib.util.find_spec(top) is not None
    if top in TARGET_STACK or (installed and top in sys.stdlib_module_names):
        return "fail", (f"needs {missing}, which today's {top} no longer has: old upstream code the "
                        "port must update for the target stack")
    if installed:
        return "skip", f"needs a newer/different {top} than installed here"
    return "skip", f"needs {top}, an upstream dependency not installed here"


def missing_dependency(exc: BaseException, tree: Path | None = None) -> tuple[str, str] | None:
    """``(verdict, line)`` for tree code whose import of a third-party package failed: ``'skip'``
    only for an upstream dependency genuinely not installed here, ``'fail'`` for what the port must
    fix (:func:`missing_import_verdict`); None when ``exc`` is no such thing (a missing megatron
    module, a blocked module, anything but ModuleNotFoundError).

    The one reporting path for a missing upstream package: every test that meets it, in process
    or in a rank of the 2-rank run, says the same line, naming the tree's importing line, so the
    report gives one ``skipped N:`` line for it.
    """
    if not isinstance(exc, ModuleNotFoundError):
        return None
    missing = exc.name or ""
    if not missing or missing.partition(".")[0] == "megatron" or is_blocked(missing):
        return None
    verdict, why = missing_import_verdict(missing)
    return verdict, f"{why} ({(tree_frame(exc, tree) if tree is not None else '') or exc})"


def import_first_or_skip(names, what: str, tree: Path | None = None):
    """:func:`import_first`, with a missing third-party dependency judged by
    :func:`skip_or_fail_missing`: ``(module or None, why none)``."""
    try:
        return import_first(names)
    except ModuleNotFoundError as exc:
        skip_or_fail_missing(exc, what, tree)


def skip_or_fail_missing(exc: ModuleNotFoundError, what: str, tree: Path | None = None):
    """Turn a failed import of tree code into a skip only for a genuinely absent optional
    dependency (:func:`missing_dependency`'s line); what the port must fix fails, and a missing
    megatron or blocked module re-raises."""
    import pytest

    judged = missing_dependency(exc, tree)
    if judged is None:
        raise exc
    verdict, line = judged
    if verdict == "fail":
        pytest.fail(f"{what} {line}", pytrace=False)
    pytest.skip(line)


def cuda_only_reason(exc: BaseException, tree: Path) -> str | None:
    """When ``exc`` is upstream code asking for CUDA on a machine without it: why, with the place."""
    text = f"{type(exc).__name__}: {exc}"
    markers = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "No CUDA GPUs are available",
               "CUDA driver initialization failed", "no CUDA-capable device")
    where = tree_frame(exc, tree)
    if Path(where.partition(":")[0]).name == "rocm_port.py":
        return None  # the port's own code must run on every device: never an era's excuse
    cuda_assert = isinstance(exc, AssertionError) and "cuda" in where.partition(": ")[2].lower()
    if not any(m in text for m in markers) and not cuda_assert:
        return None
    where = where or "upstream code"
    return f"the era's code needs a GPU here ({where}): {text}"


def distributed_backend_default(tree: Path, upstream: Upstream | None = None) -> tuple[str, str]:
    """The tree's ``--distributed-backend`` default and where it came from.

    E1–E6 declare it in arguments.py (megatron/ or megatron/training/); E7–E8 in
    megatron/training/config/common_config.py. PyPI-built trees have neither, and the value the
    series installs there is rocm_port.default_distributed_backend(): that is used then. Which
    files the era has is upstream's answer (``upstream``) where it can be read.
    """
    import argparse

    from megaport.train.example import ARGUMENT_FILES, CONFIG_FILES

    def era_has(path: str) -> bool:
        found = upstream.has(path) if upstream is not None else None
        return (tree / path).is_file() if found is None else found

    for rel in ARGUMENT_FILES:
        if not era_has(rel):
            continue
        name = rel[:-len(".py")].replace("/", ".")
        try:
            module = importlib.import_module(name)
            parser = argparse.ArgumentParser(allow_abbrev=False)
            module._add_distributed_args(parser)
            value = parser.get_default("distributed_backend")
            if value:
                return str(value), f"{name.replace('.', '/')}.py --distributed-backend default"
        except Exception:  # noqa: BLE001 - a training module this machine cannot import: next source
            continue
    if era_has(CONFIG_FILES[0]):
        try:
            module = importlib.import_module(CONFIG_FILES[0][:-len(".py")].replace("/", "."))
            import dataclasses

            for cls in vars(module).values():
                if dataclasses.is_dataclass(cls):
                    for f in dataclasses.fields(cls):
                        if f.name == "distributed_backend" and f.default is not dataclasses.MISSING:
                            return str(f.default), "megatron/training/config/common_config.py default"
        except Exception:  # noqa: BLE001
            pass
    rocm_port, _ = import_first(ROCM_PORT_MODULES)
    if rocm_port is not None and hasattr(rocm_port, "default_distributed_backend"):
        return rocm_port.default_distributed_backend(), "rocm_port.default_distributed_backend() (no megatron/training here)"
    return "nccl", "upstream's default (no rocm_port backend helper in this tree)"


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def env_with_paths(*paths: str | Path) -> dict:
    """os.environ with ``paths`` first on PYTHONPATH (for the subprocesses the suite starts)."""
    env = dict(os.environ)
    parts = [str(p) for p in paths] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
