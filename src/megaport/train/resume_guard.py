"""A resume that trains nothing is an error, never exit 0.

Upstream before f574182520 (2025-03-18) cannot load its own checkpoints on torch >= 2.6
(``weights_only``), and such a run exits 0 having trained nothing; so may any load that goes wrong
quietly. The launcher (:mod:`megaport.train.launch`) counts this rank's optimizer steps (torch's
global step hook: upstream's optimizers, the port's FusedAdam and DeepSpeed's are all torch
optimizers) and exits non-zero when the script was given ``--load``, training was asked for, and
no step ran. A step fp16 skips for an overflow is no step: a resume of only skipped steps fails too.

Before the script runs, the checkpoint a ``--load`` would resume from is looked at
(:func:`checkpoint_problem`): the tracker's iteration, its folder, and each file's size against what
the checkpoint says it wrote (``torch_dist``: the ``.metadata`` of ``torch.distributed.checkpoint``;
``torch``: each ``.pt``'s zip directory). A truncated or missing file is one line naming it and exit 1,
where upstream died of a bare ``EOFError`` (``torch_dist``), or printed "could not load the
checkpoint" and exited 0 (``torch``). Upstream writes the tracker only after a checkpoint is complete,
so a run killed while writing one resumes from the one before, which this check passes.
"""

from __future__ import annotations

import importlib
import os
import zipfile

#: upstream's tracker of the last checkpoint in a ``--load`` folder (every era)
TRACKER = "latest_checkpointed_iteration.txt"
MESSAGE = ("> megaport: error: the run was given --load {load} and asked to train to iteration {iters}, but no "
           "optimizer step ran on this rank (the checkpoint did not load, or the run stopped before training)")


def _flag(argv: list, name: str) -> str | None:
    """The value of ``name`` in ``argv`` (the last one given, as argparse takes it)."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == name]
    return values[-1] if values else None


#: the zip format's first bytes: torch.save's format since torch 1.6 (older files are plain pickles)
_ZIP_MAGIC = b"PK\x03\x04"


def _saved_iteration(load: str) -> int | None:
    """The iteration the tracker in ``load`` names (0 for a 'release' checkpoint); None without one."""
    text = _tracker_text(load)
    return None if text is None else 0 if text == "release" else int(text) if text.isdigit() else None


def _tracker_text(load: str) -> str | None:
    """What the tracker in ``load`` holds, stripped; None without one."""
    try:
        with open(os.path.join(load, TRACKER), encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return None


def training_asked(argv: list) -> tuple | None:
    """(the ``--load`` folder, the iterations asked) where ``argv`` resumes a run that has iterations
    left to train (``--finetune`` starts again from 0); None otherwise."""
    load, iters = _flag(argv, "--load"), _flag(argv, "--train-iters")
    if load is None or iters is None or not iters.isdigit() or "--skip-train" in argv:
        return None
    saved = None if "--finetune" in argv else _saved_iteration(load)
    return (load, int(iters)) if saved is None or saved < int(iters) else None


def count_steps() -> list:
    """A counter of this process's optimizer steps (a one-element list), from now on."""
    counter = [0]

    def counted(optimizer, args, kwargs):
        counter[0] += 1

    importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(counted)
    return counter


def trained_nothing(argv: list, steps: list) -> str | None:
    """The one-line error where ``argv`` asked to resume training and ``steps`` counted none; else None."""
    asked = training_asked(argv)
    if asked is None or steps[0]:
        return None
    return MESSAGE.format(load=asked[0], iters=asked[1])


def _checkpoint_folder(load: str, argv: list) -> tuple:
    """(the folder a resume from ``load`` reads, None) or (None, why it cannot name one); (None, None)
    where it reads none (no tracker: upstream starts afresh, as on a job's first run)."""
    step = _flag(argv, "--ckpt-step")
    text = step if step is not None else _tracker_text(load)
    if text is None:
        return None, None
    tracker = os.path.join(load, TRACKER)
    if text == "release":
        names = ["release"]
    elif text.isdigit():
        names = [f"iter_{int(text):07d}", f"global_step{int(text)}"]  # Megatron's; Megatron-DeepSpeed's engine
    else:
        return None, f"{tracker} holds {text[:40]!r}, not an iteration"
    for name in names:
        if os.path.isdir(os.path.join(load, name)):
            return os.path.join(load, name), None
    where = f"--ckpt-step {text}" if step is not None else f"{tracker} names iteration {text}"
    return None, f"{where}, but its checkpoint {os.path.join(load, names[0])} does not exist"


def _distcp_problem(folder: str) -> str | None:
    """A ``torch_dist`` checkpoint's files against its ``.metadata``: each there and as long as the
    data the metadata says it holds."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = os.path.join(folder, ".metadata")
    try:
        storage = FileSystemReader(folder).read_metadata().storage_data or {}
    except Exception as exc:  # noqa: BLE001 - an unreadable metadata file, whatever torch raised
        return f"{metadata} is unreadable ({type(exc).__name__}: {str(exc).strip()[:120]})"
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing (the checkpoint's .metadata lists it)"
        if os.path.getsize(path) < length:
            return f"{path} is truncated: {os.path.getsize(path)} bytes, the checkpoint's .metadata needs {length}"
    return None


def _torch_file_problem(path: str) -> str | None:
    """A ``torch.save`` file: empty, or a zip (torch's format) whose directory is gone or points past its end."""
    size = os.path.getsize(path)
    if size == 0:
        return f"{path} is empty"
    with open(path, "rb") as handle:
        if handle.read(4) != _ZIP_MAGIC:
            return None  # torch's pre-1.6 pickle format: nothing cheap to check
    try:
        with zipfile.ZipFile(path) as archive:
            ends = [info.header_offset + info.compress_size for info in archive.infolist()]
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{path} is truncated or corrupt ({size} bytes: {exc})"
    if ends and max(ends) > size:
        return f"{path} is truncated: {size} bytes, its zip directory needs {max(ends)}"
    return None


def checkpoint_problem(argv: list) -> str | None:
    """The one-line error where ``argv`` resumes (``--load``) from a checkpoint that cannot load:
    the tracker names no iteration or a missing folder, or a file is missing, empty or truncated.
    None where it is whole, or where nothing is resumed (no ``--load``, no tracker)."""
    load = _flag(argv, "--load")
    if load is None or not os.path.isdir(load):
        return None
    folder, problem = _checkpoint_folder(load, argv)
    if problem is None and folder is not None:
        problem = _folder_problem(folder)
    if problem is None:
        return None
    return f"> megaport: error: the run was given --load {load}, but its checkpoint cannot load: {problem}"


def _folder_problem(folder: str) -> str | None:
    """The first problem of a checkpoint folder: its ``torch_dist`` files, then each ``.pt`` file."""
    if os.path.isfile(os.path.join(folder, ".metadata")) and (problem := _distcp_problem(folder)):
        return problem
    files = (os.path.join(root, name) for root, _, names in sorted(os.walk(folder)) for name in sorted(names)
             if name.endswith(".pt"))
    return next((problem for path in files if (problem := _torch_file_problem(path))), None)
