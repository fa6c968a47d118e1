"""``megaport doctor``: is this machine ready to run ported Megatron, and what to change if not.

Versions (ROCm, HIP, torch, RCCL/NCCL), GPUs with their gfx arch, the environment variables that
matter on ROCm, and findings for known-bad settings, each with what to do. Findings come from
``diagnose()``, a pure function of the probe (megaport.device) and the environment, so every
rule is tested without the hardware it is about. Only well-founded rules live here; each names
its source in a comment.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from megaport import device as devices
from megaport.report import write_json

ENV_PREFIXES = ("HIP_", "ROCR_", "ROCM_", "HSA_", "NCCL_", "RCCL_", "TORCH_NCCL_", "GPU_MAX_HW_QUEUES")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_ROCM_ARCH",
             "DS_ACCELERATOR", "DS_BUILD_OPS", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK",
             "GLOO_SOCKET_IFNAME")
# AMD Instinct GPUs whose GPUs talk over xGMI links (MI200: gfx90a, MI300: gfx942, MI350: gfx950).
XGMI_ARCHS = ("gfx90a", "gfx942", "gfx950")
ROCM_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/rocm<X.Y> (the ROCm release you run)"


@dataclass
class Finding:
    level: str  # "error" (will not work) or "warning" (works, badly or surprisingly)
    code: str
    message: str
    fix: str


def relevant_environment(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def _base_arch(name: str | None) -> str | None:
    """'gfx90a:sramecc+:xnack-' → 'gfx90a'."""
    return name.split(":")[0] if name else None


def _rocm_machine(info: dict) -> bool:
    driver = info.get("driver") or {}
    return bool(driver.get("kfd") or driver.get("kfd_gfx"))


def _archs(info: dict) -> list[str]:
    archs = [_base_arch(g.get("arch")) for g in info.get("gpus") or [] if g.get("arch")]
    return archs or list((info.get("driver") or {}).get("kfd_gfx") or [])


@dataclass
class Machine:
    """What every check reads: the probe, the environment, and what follows from them."""

    info: dict
    environ: dict
    pytest_available: bool = True

    @property
    def build(self):
        return self.info.get("build")

    @property
    def driver(self) -> dict:
        return self.info.get("driver") or {}

    @property
    def rocm_machine(self) -> bool:
        return _rocm_machine(self.info)

    @property
    def rocm_context(self) -> bool:
        return self.rocm_machine or self.build == "rocm"


def check_torch_build(m: Machine) -> list[Finding]:
    """torch: present, and the right build for the machine."""
    if not m.info.get("torch"):
        return [Finding("error", "torch-missing", f"torch is not importable ({m.info.get('torch_error', 'unknown error')})",
                        f"install your platform's torch build (megaport never installs it): on ROCm {ROCM_TORCH}")]
    if m.rocm_machine and m.build in ("cuda", "cpu"):
        return [Finding(
            "error", f"torch-{m.build}-on-rocm",
            f"torch {m.info['torch']} is a {m.build.upper() if m.build == 'cuda' else 'CPU-only'} build, but this "
            "machine has AMD's GPU driver (/dev/kfd): it cannot use the GPUs",
            f"pip uninstall torch, then install ROCm's build: {ROCM_TORCH}")]
    return []


def check_device_access(m: Machine) -> list[Finding]:
    """/dev/kfd and /dev/dri are what ROCm opens (container: --device both); a ROCm torch that sees
    no GPU names the visibility variables that hide them."""
    findings, driver = [], m.driver
    if driver.get("kfd") and driver.get("kfd_access") is False:
        findings.append(Finding(
            "error", "kfd-permission", "/dev/kfd exists but this user cannot open it",
            "add the user to the 'render' and 'video' groups (sudo usermod -aG render,video $USER, then log in "
            "again); in a container pass --device=/dev/kfd --device=/dev/dri --group-add video --group-add render"))
    if driver.get("kfd") and not driver.get("dri"):
        findings.append(Finding(
            "error", "dri-missing", "/dev/kfd is present but /dev/dri is not: ROCm needs both",
            "start the container with --device=/dev/kfd --device=/dev/dri"))
    if m.build == "rocm" and m.rocm_machine and not m.info.get("gpus") and driver.get("kfd_access") is not False:
        hidden = {k: m.environ[k] for k in devices.VISIBILITY_VARIABLES if k in m.environ}
        findings.append(Finding(
            "error", "no-gpu-visible",
            "torch is a ROCm build and the driver is loaded, but torch sees no GPU"
            + (f" ({', '.join(f'{k}={v!r}' for k, v in hidden.items())})" if hidden else ""),
            "check HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES (an empty value hides every GPU) "
            "and 'rocminfo' / 'amd-smi list'"))
    return findings


def check_gpu_arch(m: Machine) -> list[Finding]:
    """The GPU's ISA must be one torch was compiled for (else: 'invalid device function' at the first kernel)."""
    arch_list = m.info.get("arch_list") or []
    if m.build != "rocm" or not arch_list:
        return []
    compiled = {_base_arch(a) for a in arch_list}
    missing = sorted({a for a in _archs(m.info) if a and a not in compiled})
    if not missing or m.environ.get("HSA_OVERRIDE_GFX_VERSION"):
        return []
    return [Finding(
        "error", "arch-not-in-torch",
        f"torch was built for {', '.join(sorted(compiled))}, not for this machine's {', '.join(missing)}: "
        "kernels fail with 'invalid device function'",
        "install a torch build (or ROCm release) that lists your GPU's gfx target")]


def check_visibility(m: Machine) -> list[Finding]:
    """On ROCm, torch (torch/cuda/__init__.py _parse_visible_devices) and the HIP runtime prefer
    HIP_VISIBLE_DEVICES; ROCR_VISIBLE_DEVICES is applied first, below HIP."""
    if not m.rocm_context:
        return []
    findings = []
    hip_vis, cuda_vis, rocr_vis = (m.environ.get(k) for k in devices.VISIBILITY_VARIABLES)
    if hip_vis is not None and cuda_vis is not None and hip_vis.replace(" ", "") != cuda_vis.replace(" ", ""):
        findings.append(Finding(
            "warning", "visible-devices-differ",
            f"HIP_VISIBLE_DEVICES={hip_vis!r} and CUDA_VISIBLE_DEVICES={cuda_vis!r} differ: HIP and torch use "
            "HIP_VISIBLE_DEVICES, while launchers and libraries that read CUDA_VISIBLE_DEVICES count other GPUs",
            "set only one of them, or give both the same list"))
    if rocr_vis is not None and hip_vis is not None:
        if len(hip_vis.split(",")) > len(rocr_vis.split(",")):
            findings.append(Finding(
                "error", "hip-beyond-rocr",
                f"HIP_VISIBLE_DEVICES={hip_vis!r} names more GPUs than ROCR_VISIBLE_DEVICES={rocr_vis!r} leaves "
                "(torch raises RuntimeError at the first GPU call)",
                "HIP_VISIBLE_DEVICES indexes the GPUs that ROCR_VISIBLE_DEVICES leaves: renumber it from 0, or "
                "unset one of the two"))
        else:
            findings.append(Finding(
                "warning", "hip-and-rocr",
                f"ROCR_VISIBLE_DEVICES={rocr_vis!r} and HIP_VISIBLE_DEVICES={hip_vis!r} are both set: HIP's indices "
                "count only the GPUs ROCR leaves, not the machine's",
                "prefer ROCR_VISIBLE_DEVICES alone (AMD's recommendation on Linux), or check the mapping with "
                "'megaport doctor' inside the job"))
    for name in devices.VISIBILITY_VARIABLES:
        if m.environ.get(name) == "":
            findings.append(Finding("warning", "visible-devices-empty", f"{name} is set but empty: it hides every GPU",
                                    f"unset {name}, or list the GPUs to use"))
    return findings


def check_rccl(m: Machine) -> list[Finding]:
    """Peer-to-peer over xGMI is how MI200/MI300 GPUs exchange data (RCCL docs, usage tips);
    NCCL_P2P_DISABLE=1 is a workaround for PCIe consumer GPUs that routes traffic through host memory."""
    archs = _archs(m.info)
    xgmi = sorted(set(a for a in archs if a in XGMI_ARCHS))
    if m.environ.get("NCCL_P2P_DISABLE", "0") in ("0", "") or not xgmi:
        return []
    return [Finding(
        "warning", "p2p-disabled-on-xgmi",
        f"NCCL_P2P_DISABLE={m.environ['NCCL_P2P_DISABLE']} on {', '.join(xgmi)} "
        "GPUs: RCCL stops using the xGMI links between GPUs and goes through host memory, losing most "
        "of its bandwidth",
        "unset NCCL_P2P_DISABLE (it is meant for PCIe GPUs without working peer-to-peer)")]


#: interfaces that reach no other node: a multi-node rendezvous bound to them waits for ever
_LOCAL_INTERFACES = ("lo", "docker0")


def check_multi_node(m: Machine) -> list[Finding]:
    """A run across nodes (MASTER_ADDR another machine's, as AMD's Megatron guide sets it for
    NNODES > 1): RCCL and Megatron's gloo groups each pick a network interface of their own unless
    told (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), and RCCL's RDMA needs its NICs named
    (NCCL_IB_HCA; NCCL_IB_GID_INDEX=3 for RoCE v2, as the guide's rccl-tests run)."""
    address = m.environ.get("MASTER_ADDR", "")
    if not address or address in ("localhost", "::1") or address.startswith("127."):
        return []
    findings = []
    for name, who in (("NCCL_SOCKET_IFNAME", "RCCL's bootstrap and socket transport"),
                      ("GLOO_SOCKET_IFNAME", "torch's gloo groups (Megatron's CPU-side groups)")):
        value = m.environ.get(name)
        if value is None:
            findings.append(Finding(
                "warning", f"{name.lower().replace('_', '-')}-unset",
                f"MASTER_ADDR={address} (a run across nodes) and {name} unset: {who} pick(s) an interface by "
                "themselves, which may be one the other nodes cannot reach",
                f"export {name}=<the interface the nodes reach each other on, e.g. ens50f0np0>"))
        elif value.split(",")[0].lstrip("=^") in _LOCAL_INTERFACES:
            findings.append(Finding("error", f"{name.lower().replace('_', '-')}-local",
                                    f"{name}={value} with MASTER_ADDR={address}: that interface reaches no other node",
                                    f"set {name} to the interface the nodes reach each other on"))
    if m.rocm_context and not m.environ.get("NCCL_IB_HCA"):
        findings.append(Finding(
            "warning", "nccl-ib-hca-unset",
            f"MASTER_ADDR={address} (a run across nodes) and NCCL_IB_HCA unset: RCCL uses every RDMA device it "
            "finds, or falls back to TCP sockets where it finds none",
            "export NCCL_IB_HCA=<your RDMA NICs, e.g. rdma0:1,rdma1:1,...> (and NCCL_IB_GID_INDEX=3 on RoCE v2)"))
    return findings


def check_rocr_runtime(m: Machine) -> list[Finding]:
    """ROCr settings (ROCR-Runtime environment variables): HSA_ENABLE_SDMA=0 disables the DMA
    engines for every copy, which then run as blit kernels on the compute units."""
    findings = []
    if m.environ.get("HSA_ENABLE_SDMA") == "0":
        findings.append(Finding(
            "warning", "sdma-disabled",
            "HSA_ENABLE_SDMA=0 turns off the DMA copy engines for all host<->device and device<->device copies: "
            "they run as kernels on the compute units instead, competing with training kernels",
            "unset HSA_ENABLE_SDMA unless it works around a specific hang you have seen on this ROCm release"))
    if m.environ.get("HSA_OVERRIDE_GFX_VERSION") and m.rocm_context:
        findings.append(Finding(
            "warning", "gfx-override",
            f"HSA_OVERRIDE_GFX_VERSION={m.environ['HSA_OVERRIDE_GFX_VERSION']} makes the runtime treat every GPU as "
            "that target and run code built for it",
            "use it only for GPUs ROCm does not support; unset it on supported (Instinct) GPUs"))
    return findings


def check_cuda_toolkit(m: Machine) -> list[Finding]:
    """CUDA toolkit settings on a ROCm machine: extension builds (apex, TransformerEngine, unported
    Megatron's fused_kernels, which probe CUDA_HOME/bin/nvcc) would try to use nvcc."""
    cuda_home = m.environ.get("CUDA_HOME") or m.environ.get("CUDA_PATH")
    if not cuda_home or not m.rocm_context:
        return []
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    return [Finding(
        "warning", "cuda-home-on-rocm",
        f"CUDA_HOME/CUDA_PATH={cuda_home} on a ROCm machine" + (" (it has bin/nvcc)" if nvcc.exists() else "")
        + ": extension builds (apex, TransformerEngine, Megatron's fused kernels) look for nvcc there",
        "unset CUDA_HOME and CUDA_PATH; ROCm builds use ROCM_PATH (e.g. /opt/rocm)")]


def check_attention(m: Machine) -> list[Finding]:
    """Whether the port's core attention gets a fused SDPA kernel on this GPU: on RDNA3, PyTorch's
    AOTriton kernels are experimental and off unless TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 (PyTorch
    ROCm notes), and SDPA then falls back to its math path silently; elsewhere the probe says."""
    findings = []
    rdna3 = sorted({a for a in _archs(m.info) if a in devices.AOTRITON_EXPERIMENTAL_ARCHS})
    if m.info.get("build") == "rocm" and rdna3 and m.environ.get(devices.AOTRITON_EXPERIMENTAL_ENV) != "1":
        findings.append(Finding(
            "warning", "aotriton-experimental-off",
            f"{', '.join(rdna3)} (RDNA3): PyTorch's AOTriton flash attention is experimental there and off, so the "
            "port's core attention (scaled_dot_product_attention) runs SDPA's math path, no faster than unfused",
            f"export {devices.AOTRITON_EXPERIMENTAL_ENV}=1"))
    gpu = (m.info.get("attention") or {}).get("gpu")
    if gpu and not gpu.get("flash") and not gpu.get("efficient") and not findings:
        findings.append(Finding(
            "warning", "sdpa-math-only",
            f"scaled_dot_product_attention has no flash or memory-efficient kernel for this GPU "
            f"({gpu.get('flash_error', 'unknown reason')}): the port's core attention runs SDPA's math path",
            "use a torch build with AOTriton for your GPU (PyTorch >= 2.3 on MI200/MI300), or keep the port's "
            "softmax path with MEGATRON_ROCM_PORT_SDPA=0"))
    return findings


def check_pytest(m: Machine) -> list[Finding]:
    if m.pytest_available:
        return []
    return [Finding("warning", "pytest-missing", "pytest is not installed: 'megaport verify' needs it",
                    "pip install 'pytest>=8'")]


#: One check per area, in the order their findings print; adding one adds a row, never a branch.
CHECKS = (
    ("torch build", check_torch_build),
    ("device access", check_device_access),
    ("GPU arch", check_gpu_arch),
    ("visible devices", check_visibility),
    ("RCCL", check_rccl),
    ("several nodes", check_multi_node),
    ("ROCr runtime", check_rocr_runtime),
    ("CUDA toolkit", check_cuda_toolkit),
    ("attention kernels", check_attention),
    ("verify's tools", check_pytest),
)


def diagnose(info: dict, environ: dict, *, pytest_available: bool = True) -> list[Finding]:
    """Every check's findings for this probe and environment (a pure function: tested without the
    hardware each rule is about)."""
    machine = Machine(info, environ, pytest_available)
    return [finding for _, check in CHECKS for finding in check(machine)]


def deepspeed_row(status: dict | None) -> str:
    """DeepSpeed's version, accelerator and ops, as one line (what ``ds_report`` would list)."""
    if status is None:
        return "not installed (Megatron-DeepSpeed trees need it: pip install deepspeed)"
    if "error" in status:
        return status["error"]
    ops = status.get("ops") or {}
    if "error" in ops:
        listed = f"ops: {ops['error']}"
    else:
        prebuilt = sorted(n for n, o in ops.items() if o.get("installed"))
        buildable = sorted(n for n, o in ops.items() if not o.get("installed") and o.get("compatible"))
        neither = sorted(n for n, o in ops.items() if not o.get("installed") and not o.get("compatible"))
        listed = (f"ops prebuilt: {', '.join(prebuilt) or 'none'}; built at run time if used: "
                  f"{', '.join(buildable) or 'none'}; unavailable here: {', '.join(neither) or 'none'}")
    return (f"{status.get('version')} (accelerator {status.get('accelerator')}, backend "
            f"{status.get('communication_backend')}); {listed}")


def doctor(console, *, json_file: str | None = None, environ=None, info: dict | None = None,
           deepspeed_status: dict | None | bool = False) -> int:
    from rich.markup import escape
    from rich.table import Table

    environ = dict(os.environ if environ is None else environ)
    info = info if info is not None else devices.probe_subprocess()
    findings = diagnose(info, environ, pytest_available=importlib.util.find_spec("pytest") is not None)

    table = Table(title="versions and devices", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in devices.summary_rows(info):
        table.add_row(label, escape(value))
    if info.get("rocm") and not any(label == "ROCm" for label, _ in devices.summary_rows(info)):
        table.add_row("ROCm", info["rocm"])
    driver = info.get("driver") or {}
    table.add_row("driver", escape(
        ("/dev/kfd" + (" (no access)" if driver.get("kfd_access") is False else "") if driver.get("kfd") else "no /dev/kfd")
        + (", /dev/dri" if driver.get("dri") else "") + (", NVIDIA" if driver.get("nvidia") else "")
        + (f", KFD GPUs: {' '.join(driver['kfd_gfx'])}" if driver.get("kfd_gfx") else "")))
    if info.get("arch_list"):
        table.add_row("torch built for", " ".join(info["arch_list"]))
    if deepspeed_status is False:  # not given: ask DeepSpeed itself (a subprocess; None when not installed)
        from megaport import deepspeed_fork

        deepspeed_status = deepspeed_fork.status()
    table.add_row("DeepSpeed", escape(deepspeed_row(deepspeed_status)))
    console.print(table)

    env = relevant_environment(environ)
    env_table = Table(title="environment", show_header=False, title_justify="left")
    env_table.add_column(style="bold")
    env_table.add_column()
    for name, value in env.items():
        env_table.add_row(name, escape(value))
    if not env:
        env_table.add_row("(none set)", "HIP_*, ROCR_*, HSA_*, NCCL_*, RCCL_*, CUDA_VISIBLE_DEVICES, CUDA_HOME")
    console.print(env_table)

    for finding in findings:
        colour = "red" if finding.level == "error" else "yellow"
        console.print(f"[{colour}]{finding.level}[/] {escape(finding.message)}\n    → {escape(finding.fix)}")
    if not findings:
        console.print("[green]no problems found[/]")
    write_json(json_file, {"versions": info, "environment": env, "deepspeed": deepspeed_status,
                           "findings": [asdict(f) for f in findings]})
    return 1 if any(f.level == "error" for f in findings) else 0
