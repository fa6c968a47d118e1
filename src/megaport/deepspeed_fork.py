"""microsoft/Megatron-DeepSpeed trees, and DeepSpeed on this machine.

The fork imports deepspeed unconditionally and chooses code paths by DeepSpeed's accelerator
(``get_accelerator().device_name() == 'cuda'``), which is 'cuda' on ROCm GPUs too: there the fork
takes apex and the fused kernels, which the series serve in PyTorch. On a machine without a GPU
DeepSpeed picks its CPU accelerator and the fork other paths (torch's Adam, torch's LayerNorm), so
runs that check the port on a CPU set ``DS_ACCELERATOR=cuda``: the fork then takes the paths it
takes on a ROCm GPU, with megaport's CPU substitutions under them (:mod:`megaport.cpu_substitutions`:
the ``deepspeed`` and ``fork-checks`` profiles).
"""

from __future__ import annotations

import functools

ACCELERATOR_ENV = "DS_ACCELERATOR"
#: What DeepSpeed picks on ROCm (and CUDA) GPUs, and so what a check of the port must run.
GPU_ACCELERATOR = "cuda"


#: The fork's repository, as the catalogue's ``[[fork]]`` names it.
REPOSITORY = "microsoft/Megatron-DeepSpeed"


@functools.lru_cache(maxsize=1)
def _catalogue_forks() -> tuple:
    from megaport.catalogue import load_catalogue

    return load_catalogue().forks


def is_deepspeed_tree(tree) -> bool:
    """A Megatron-DeepSpeed tree: the catalogue's ``[[fork]]`` marks for it hold, the one rule
    ``apply`` also gives the tree the fork's series by (its pretrain_gpt.py or initialize.py imports
    deepspeed at module level)."""
    from megaport.selection import FolderReader, tree_fork

    fork, _ = tree_fork(FolderReader(tree), _catalogue_forks())
    return fork is not None and fork.repository == REPOSITORY


def accelerator_env(tree, env: dict) -> dict:
    """``env`` with DeepSpeed's accelerator set to the GPU one for a fork tree, unless the user set it."""
    if is_deepspeed_tree(tree) and not env.get(ACCELERATOR_ENV):
        env = {**env, ACCELERATOR_ENV: GPU_ACCELERATOR}
    return env


def status() -> dict | None:
    """DeepSpeed's version, its accelerator and its ops' status (what ``ds_report`` shows: whether
    each op is prebuilt into the wheel and whether it can be built at run time here), without
    building anything; None when DeepSpeed is not installed. Runs in a subprocess: importing
    deepspeed imports torch and picks an accelerator."""
    import json
    import subprocess
    import sys

    code = r'''
import json, os
os.environ.setdefault("DS_BUILD_OPS", "0")
try:
    import deepspeed
except ImportError:
    print(json.dumps(None)); raise SystemExit(0)
from deepspeed.accelerator import get_accelerator
ops = {}
try:
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:
        installed_ops = {}
    for name, builder in sorted(ALL_OPS.items()):
        try:
            compatible = bool(builder.is_compatible(verbose=False))
        except TypeError:
            compatible = bool(builder.is_compatible())
        except Exception:
            compatible = False
        ops[name] = {"installed": bool(installed_ops.get(name, False)), "compatible": compatible}
except Exception as exc:
    ops = {"error": str(exc)}
accelerator = get_accelerator()
print(json.dumps({"version": deepspeed.__version__, "accelerator": accelerator.device_name(),
                  "communication_backend": accelerator.communication_backend_name(), "ops": ops}))
'''
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "null"))]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"importing deepspeed failed: {tail}"}
    return json.loads(lines[-1])
