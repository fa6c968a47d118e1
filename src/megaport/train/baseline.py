"""The yardstick: the unported upstream commit a ported tree came from, as a user without megaport
runs it (its fusions off, none of the series' changes).

It is exported from the tree's own git objects into a temporary folder, so the tree is never
touched. Some eras' unported upstream cannot even start on today's stack without help; there,
and only after a run died of exactly that, the baseline gets the shim that answers it, each
listed in the report: see :mod:`megaport.train.shims`, one module per shim, none of them the
port's code. Every baseline process reports at exit that it loaded nothing of the port, and a
run that did is an error, never a parity figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

from megaport.envpaths import with_paths_first, without_pythonpath
from megaport.train.example import flag_value
from megaport.train.tree_files import exported
from megaport.train.shims import registry as shims
from megaport.train.failure import RunFailed


@contextlib.contextmanager
def unported_upstream(tree, sha: str):
    """The commit ``sha`` of ``tree``'s history exported to a folder (once a process: every baseline
    run shares it, :func:`megaport.train.tree_files.exported`), and an environment without the
    tree's PYTHONPATH: ``(folder, env)``."""
    own = megaport_import_path()
    yield exported(str(tree), sha), with_paths_first(without_pythonpath(), own) if own else without_pythonpath()


def megaport_import_path() -> str | None:
    """The folder this megaport imports from where it is not an installed package (a source
    checkout on PYTHONPATH): the baseline's processes then run the same megaport (its launcher,
    CPU substitutions and shims) as the process comparing with them, not whichever copy the
    environment has installed. None for an installed megaport: site-packages stays where it is."""
    import site
    import sysconfig

    import megaport

    folder = os.path.dirname(os.path.dirname(os.path.abspath(megaport.__file__)))
    installed = {os.path.abspath(p) for p in [*site.getsitepackages(), site.getusersitepackages(),
                                             sysconfig.get_path("purelib"), sysconfig.get_path("platlib")] if p}
    return None if folder in installed else folder


def with_shims_as_needed(start, env: dict, *, attempts: int = 8, first: tuple = ()) -> tuple:
    """``start(env)`` on an unported upstream, retried with one more shim each time it dies of a
    failure a shim answers: (its result, the shims it needed). ``first``: shims it starts with (a
    model family's own needs). Any other failure is raised as it is."""
    names: list = list(first)
    for _ in range(attempts):
        try:
            return start(shims.environment(env, names)), names
        except RunFailed as exc:
            needed = shims.pick(exc.failures, names)
            if needed is None:
                raise
            names.append(needed)
    raise RuntimeError(f"the unported upstream did not start even with the shims {names}")


def with_fewest_shims(start, env: dict, *, attempts: int = 8, first: tuple = ()) -> tuple:
    """:func:`with_shims_as_needed` for a baseline run, whose processes must report that they loaded
    none of the port's code: a run that did is an error, never a parity figure."""
    result, names = with_shims_as_needed(start, env, attempts=attempts, first=first)
    loaded = result.get("baseline_port_code")
    if loaded is None:
        raise RuntimeError("the baseline's processes did not report what they loaded (megaport's "
                           "baseline start-up did not run in them): the baseline cannot be trusted")
    if loaded:
        raise RuntimeError(f"the unported baseline loaded the port's code ({', '.join(loaded)}): "
                           "loss parity against it would compare the port with itself")
    return result, names


#: what an unported run that loads a checkpoint starts with, where it applies: eras that print a refused
#: load and exit leave no exception for a shim to answer
LOADING_SHIMS = ("torch-load-trusting",)


def gives(run, flag: str) -> bool:
    """Whether ``run`` gives upstream ``flag`` (``--load``, ``--save``): its own field, or a check's extra flags."""
    field = {"--load": run.load, "--save": run.save}.get(flag)
    return bool(field) or any(flag in added for added, _ in run.extra)


def save_folder(run) -> str | None:
    """Where ``run`` has upstream write its checkpoints (``--save``: its own field, or a check's
    extra flags), or None."""
    return run.save or flag_value([token for added, _ in run.extra for token in added], "--save")


def clean_retries(start, folder: str | None):
    """``start``, which takes back what a failed attempt wrote into ``folder`` before the next one:
    an attempt that died writing its checkpoint (core 0.9's writer on today's torch, before its
    shim) left ``iter_0000015`` half written, and upstream's save then refused the retry ("Checkpoint
    destination directory ... is not empty"). What was there before the attempt (a checkpoint it
    resumes from) stays."""
    def attempt(env):
        before = set(os.listdir(folder)) if folder and os.path.isdir(folder) else set()
        try:
            return start(env)
        except RunFailed:
            for name in (set(os.listdir(folder)) - before) if folder and os.path.isdir(folder) else ():
                path = os.path.join(folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            raise
    return attempt


def run_unported(run, sha: str, also: tuple = (), where_they_apply: tuple = ()) -> tuple[dict, list]:
    """``run`` (a pretrain.Run on a ported tree) on the tree's unported upstream commit ``sha``, as
    given (its mode, sizes, learning rate and dropout): (the result, the shims it needed, listed in
    the result). ``also``: shims a check starts it with beside the family's (what the box it stands
    for has, such as apex); ``where_they_apply``: shims it starts with where the unported tree's era
    needs them (each shim's ``applies``), as the family's own."""
    from megaport.train.families import registry
    from megaport.train.pretrain import run_pretrain

    with unported_upstream(run.tree, sha) as (folder, env):
        upstream = dataclasses.replace(run, tree=folder)
        wanted = [*(LOADING_SHIMS if gives(run, "--load") else ()), *where_they_apply,
                  *registry.get(run.family).baseline_shims]
        result, names = with_fewest_shims(clean_retries(lambda shimmed: run_pretrain(upstream, shimmed),
                                                        save_folder(run)), env,
                                          first=[*also, *dict.fromkeys(name for name in wanted
                                                                       if shims.applies(name, folder) and name not in also)])
    result["baseline_shims"] = [shims.describe(s) for s in names]
    return result, names
