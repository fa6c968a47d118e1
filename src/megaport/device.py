"""What the machine offers Megatron: torch build, GPUs, gfx arch, RCCL/NCCL, visibility variables.

``probe()`` runs wherever torch is to be judged and never raises: it reports what it finds, with
``torch: None`` and the import error when torch is missing. megaport itself never imports torch,
so commands call ``probe_subprocess()``, which runs this file with the chosen interpreter and
reads one JSON line back (a broken GPU stack then cannot take megaport down with it).

Only the standard library is imported at module level.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megaport.errors import MegaportError

# Variables that decide which GPUs a process sees. On ROCm torch prefers HIP_VISIBLE_DEVICES over
# CUDA_VISIBLE_DEVICES, and ROCR_VISIBLE_DEVICES filters first (torch/cuda/__init__.py).
VISIBILITY_VARIABLES = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
ROCM_VERSION_FILES = (".info/version", ".info/version-dev")
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


def visible_devices_env(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in VISIBILITY_VARIABLES if environ.get(name) is not None}


def rocm_path(environ=None) -> Path | None:
    """The ROCm installation: $ROCM_PATH, $ROCM_HOME, else /opt/rocm when it exists."""
    environ = os.environ if environ is None else environ
    for name in ("ROCM_PATH", "ROCM_HOME"):
        if environ.get(name):
            return Path(environ[name])
    default = Path("/opt/rocm")
    return default if default.exists() else None


def rocm_version(environ=None) -> str | None:
    """The installed ROCm release from its .info/version file (None when there is none)."""
    root = rocm_path(environ)
    if root is None:
        return None
    for name in ROCM_VERSION_FILES:
        try:
            text = (root / name).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text:
            return text.splitlines()[0].strip()
    return None


def gfx_name(target_version: int) -> str | None:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) → 'gfx942', 'gfx90a'."""
    if target_version <= 0:
        return None
    major, rest = divmod(target_version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"


def kfd_gfx_targets(nodes: Path = KFD_NODES) -> list[str]:
    """gfx arch of each GPU node the amdgpu kernel driver reports, without any ROCm userspace."""
    targets = []
    try:
        entries = sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0)
    except OSError:
        return targets
    for node in entries:
        try:
            text = (node / "properties").read_text(encoding="utf-8")
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and value.strip().isdigit():
                name = gfx_name(int(value))
                if name:  # CPU nodes report 0
                    targets.append(name)
    return targets


def kernel_driver() -> dict:
    """Device files of the GPU drivers: /dev/kfd and /dev/dri (AMD), /dev/nvidia0 (NVIDIA)."""
    kfd = Path("/dev/kfd")
    return {
        "kfd": kfd.exists(),
        "kfd_access": os.access(kfd, os.R_OK | os.W_OK) if kfd.exists() else None,
        "dri": Path("/dev/dri").exists(),
        "nvidia": Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists(),
        "kfd_gfx": kfd_gfx_targets(),
    }


def _collective(torch) -> dict:
    name = "RCCL" if getattr(torch.version, "hip", None) else "NCCL"
    version = None
    try:
        raw = torch.cuda.nccl.version()
        if isinstance(raw, (tuple, list)):
            version = ".".join(str(int(p)) for p in raw)
        elif isinstance(raw, int):
            version = (f"{raw // 10000}.{(raw % 10000) // 100}.{raw % 100}" if raw >= 10000
                       else f"{raw // 1000}.{(raw % 1000) // 100}.{raw % 100}")
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL; report, never raise
        version = None
    return {"name": name, "version": version}


def _triton_version() -> str | None:
    """Triton's version where it imports (GPU builds of torch ship it): the port's softmax is
    compiled with it on GPUs, and runs its eager path without it."""
    try:
        import triton
    except Exception:  # noqa: BLE001 - absent, or a broken install
        return None
    return str(getattr(triton, "__version__", "installed"))


#: RDNA3 GPUs, whose AOTriton attention kernels PyTorch ships as experimental: without
#: TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 scaled_dot_product_attention takes its math path there.
AOTRITON_EXPERIMENTAL_ARCHS = ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151")
AOTRITON_EXPERIMENTAL_ENV = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"


def _attention_probe(torch, device: str) -> dict:
    """Whether scaled_dot_product_attention's flash kernel runs here (bf16, causal, head dim 64,
    forward and backward): the port's core attention takes it where it does, and the memory-efficient
    or math kernel otherwise. Asked by running it with only that kernel allowed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            q = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            out[name] = True
        except Exception as exc:  # noqa: BLE001 - the kernel is not built for this device or input
            out[name] = False
            out[f"{name}_error"] = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return out


def probe() -> dict:
    """Everything this interpreter's torch says about the machine; never raises."""
    info: dict = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": None,
        "build": None,
        "hip": None,
        "cuda": None,
        "rocm": rocm_version(),
        "gpu_available": False,
        "gpus": [],
        "collective": None,
        "distributed": {},
        "visible_devices": visible_devices_env(),
        "driver": kernel_driver(),
    }
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install's OSError
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
        return info
    info["torch"] = torch.__version__
    info["torch_file"] = getattr(torch, "__file__", None)
    info["hip"] = getattr(torch.version, "hip", None)
    info["cuda"] = getattr(torch.version, "cuda", None)
    info["build"] = "rocm" if info["hip"] else "cuda" if info["cuda"] else "cpu"
    try:
        available = bool(torch.cuda.is_available())
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:  # noqa: BLE001
        available, count = False, 0
        info["gpu_error"] = f"{type(exc).__name__}: {exc}"
    info["gpu_available"] = available
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
        except Exception as exc:  # noqa: BLE001
            info["gpus"].append({"index": index, "error": str(exc)})
            continue
        arch = getattr(props, "gcnArchName", None) or None
        if not arch and info["cuda"]:
            arch = f"sm_{props.major}{props.minor}"
        info["gpus"].append({
            "index": index,
            "name": props.name,
            "arch": arch,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "compute_units": getattr(props, "multi_processor_count", None),
        })
    if info["build"] != "cpu":
        info["collective"] = _collective(torch)
        info["triton"] = _triton_version()
        try:
            info["arch_list"] = list(torch.cuda.get_arch_list())
        except Exception:  # noqa: BLE001
            info["arch_list"] = None
    info["attention"] = {"cpu": _attention_probe(torch, "cpu")}
    if available and count:
        info["attention"]["gpu"] = _attention_probe(torch, "cuda")
    try:
        import torch.distributed as dist

        info["distributed"] = {
            "available": dist.is_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
        }
    except Exception:  # noqa: BLE001
        info["distributed"] = {"available": False}
    return info


def probe_subprocess(python: str | None = None, env: dict | None = None, timeout: float = 180) -> dict:
    """``probe()`` run by ``python`` (default: this interpreter) in a fresh process."""
    # Run the file by path without putting its folder first on sys.path (its siblings would
    # shadow any top-level module of the same name).
    code = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    command = [python or sys.executable, "-c", code]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"torch": None, "torch_error": f"probing torch took longer than {timeout:.0f} s (a hung GPU driver?)"}
    except OSError as exc:
        return {"torch": None, "torch_error": f"cannot run {command[0]}: {exc}"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"torch": None, "torch_error": f"probe exited {proc.returncode}: {tail[0]}"}


def device_kind(info: dict) -> str:
    """'hip', 'cuda' or 'cpu': what --device auto picks for this probe."""
    if info.get("gpu_available") and info.get("gpus"):
        return "hip" if info.get("hip") else "cuda"
    return "cpu"


def summary_rows(info: dict) -> list[tuple[str, str]]:
    """(label, value) lines shared by verify, bench and doctor."""
    rows = [("python", f"{info.get('python', '?')} ({info.get('executable', '?')})")]
    if not info.get("torch"):
        rows.append(("torch", f"not importable: {info.get('torch_error', 'unknown')}"))
        return rows
    build = info.get("build")
    rows.append(("torch", f"{info['torch']} ({build} build)"))
    if info.get("hip"):
        rows.append(("HIP", str(info["hip"])))
    if info.get("cuda"):
        rows.append(("CUDA", str(info["cuda"])))
    if info.get("rocm"):
        rows.append(("ROCm", str(info["rocm"])))
    gpus = info.get("gpus") or []
    if gpus:
        for gpu in gpus:
            if "error" in gpu:
                rows.append((f"GPU {gpu['index']}", f"error: {gpu['error']}"))
            else:
                rows.append((f"GPU {gpu['index']}", f"{gpu['name']}, {gpu.get('arch') or '?'}, {gpu['memory_gib']} GiB"))
    else:
        rows.append(("GPUs", "none visible to torch"))
    if build != "cpu":
        triton = info.get("triton")
        rows.append(("Triton", f"{triton} (the port's softmax is compiled with it on GPUs)" if triton
                     else "not importable: the port's softmax runs its eager path"))
    attention = info.get("attention") or {}
    for where in ("gpu", "cpu"):
        found = attention.get(where)
        if found:
            kernel = "flash" if found.get("flash") else "memory-efficient" if found.get("efficient") else "math"
            rows.append((f"attention ({where.upper()})", f"scaled_dot_product_attention takes its {kernel} kernel"))
    collective = info.get("collective")
    if collective:
        rows.append((collective["name"], collective.get("version") or "version unknown"))
    visible = info.get("visible_devices") or {}
    rows.append(("visible devices", ", ".join(f"{k}={v}" for k, v in visible.items()) or "all (no *_VISIBLE_DEVICES set)"))
    return rows


if __name__ == "__main__":  # pragma: no cover - exercised through probe_subprocess
    print(json.dumps(probe()))


TORCH_HINT = (
    "install the torch build for your platform first (megaport never installs torch): on ROCm, "
    "ROCm's build, e.g. pip install torch --index-url https://download.pytorch.org/whl/rocm<version>; "
    "on NVIDIA, a CUDA build; elsewhere the CPU build"
)


def require_torch(info: dict, python: str) -> None:
    if not info.get("torch"):
        error = info.get("torch_error", "not importable")
        raise MegaportError(f"torch is not importable by {python} ({error}); {TORCH_HINT}", exit_code=2)


def resolve_device(requested: str, info: dict) -> str:
    """'hip', 'cuda' or 'cpu'; a requested GPU this machine cannot give fails at once (exit 2)."""
    if requested == "auto":
        return device_kind(info)
    if requested == "cpu":
        return "cpu"
    build = info.get("build")
    count = len(info.get("gpus") or []) if info.get("gpu_available") else 0
    if requested == "hip":
        if build != "rocm":
            raise MegaportError(
                f"--device hip: torch {info.get('torch')} is a {build} build (torch.version.hip is None); "
                "install ROCm's torch build, or use --device auto", exit_code=2)
        if count == 0:
            raise MegaportError(
                "--device hip: torch sees no HIP GPU (torch.cuda.device_count() == 0); check that /dev/kfd and "
                "/dev/dri are accessible (render/video groups) and HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES "
                "(run 'megaport doctor')", exit_code=2)
        return "hip"
    if build == "rocm":
        raise MegaportError("--device cuda: torch is a ROCm build; use --device hip", exit_code=2)
    if build != "cuda":
        raise MegaportError(f"--device cuda: torch {info.get('torch')} is a {build} build; install a CUDA build "
                            "or use --device cpu", exit_code=2)
    if count == 0:
        raise MegaportError("--device cuda: torch sees no CUDA GPU (torch.cuda.device_count() == 0); "
                            "check the driver and CUDA_VISIBLE_DEVICES", exit_code=2)
    return "cuda"
