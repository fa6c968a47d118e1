"""`megaport doctor`: each rule on the machine it is about (synthetic probes), and the real command here."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from megaport import device as devices
from megaport.cli import main
from megaport.commands.doctor import diagnose, relevant_environment

DRIVER_AMD = {"kfd": True, "kfd_access": True, "dri": True, "nvidia": False, "kfd_gfx": ["gfx942"] * 8}
MI300 = {"torch": "2.9.0+rocm6.4", "build": "rocm", "hip": "6.4.1", "cuda": None, "gpu_available": True,
         "gpus": [{"index": i, "name": "AMD Instinct MI300X", "arch": "gfx942:sramecc+:xnack-", "memory_gib": 192.0}
                  for i in range(8)],
         "arch_list": ["gfx90a", "gfx942"], "driver": DRIVER_AMD, "rocm": "6.4.1"}
CPU_BOX = {"torch": "2.13.0+cpu", "build": "cpu", "hip": None, "cuda": None, "gpu_available": False, "gpus": [],
           "driver": {"kfd": False, "kfd_access": None, "dri": False, "nvidia": False, "kfd_gfx": []}}


def codes(info, env=None, **kwargs):
    return {f.code: f for f in diagnose(info, env or {}, **kwargs)}


def test_a_healthy_mi300_node_has_no_findings():
    assert codes(MI300, {"HIP_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO"}) == {}


def test_a_cpu_machine_has_no_findings():
    assert codes(CPU_BOX) == {}


def test_every_finding_says_what_to_do():
    env = {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1", "NCCL_P2P_DISABLE": "1", "HSA_ENABLE_SDMA": "0",
           "CUDA_HOME": "/usr/local/cuda", "HSA_OVERRIDE_GFX_VERSION": "9.4.2", "ROCR_VISIBLE_DEVICES": "0,1"}
    found = diagnose(MI300, env, pytest_available=False)
    assert len(found) >= 7
    for finding in found:
        assert finding.level in ("error", "warning") and finding.message and finding.fix


def test_torch_missing():
    found = codes({"torch": None, "torch_error": "ModuleNotFoundError: No module named 'torch'", "driver": DRIVER_AMD})
    assert found["torch-missing"].level == "error" and "rocm" in found["torch-missing"].fix


@pytest.mark.parametrize("build", ["cuda", "cpu"])
def test_wrong_torch_build_on_a_rocm_machine(build):
    info = {**MI300, "build": build, "hip": None, "cuda": "12.8" if build == "cuda" else None, "gpus": [],
            "gpu_available": False}
    finding = codes(info)[f"torch-{build}-on-rocm"]
    assert finding.level == "error" and "/dev/kfd" in finding.message and "pip uninstall torch" in finding.fix


def test_kfd_without_permission_and_missing_dri():
    info = {**MI300, "gpus": [], "gpu_available": False,
            "driver": {**DRIVER_AMD, "kfd_access": False, "dri": False}}
    found = codes(info)
    assert "render" in found["kfd-permission"].fix and "--device=/dev/dri" in found["dri-missing"].fix
    assert "no-gpu-visible" not in found  # the permission is the cause, said once


def test_rocm_torch_that_sees_no_gpu_names_the_visibility_variable():
    info = {**MI300, "gpus": [], "gpu_available": False}
    found = codes(info, {"HIP_VISIBLE_DEVICES": ""})
    assert "HIP_VISIBLE_DEVICES=''" in found["no-gpu-visible"].message
    assert "visible-devices-empty" in found


def test_gpu_arch_missing_from_the_torch_build():
    info = {**MI300, "arch_list": ["gfx90a", "gfx1100"]}
    finding = codes(info)["arch-not-in-torch"]
    assert "gfx942" in finding.message and "invalid device function" in finding.message


def test_hip_and_cuda_visible_devices_differ():
    finding = codes(MI300, {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "2,3"})["visible-devices-differ"]
    assert finding.level == "warning" and "set only one" in finding.fix
    assert "visible-devices-differ" not in codes(MI300, {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0, 1"})
    # On a machine without ROCm the HIP variable means nothing: no warning.
    assert "visible-devices-differ" not in codes(CPU_BOX, {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"})


def test_hip_visible_devices_beyond_rocr():
    assert codes(MI300, {"ROCR_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "0,1"})["hip-beyond-rocr"].level == "error"
    assert codes(MI300, {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1"})["hip-and-rocr"].level == "warning"


def test_p2p_disabled_only_matters_on_xgmi_gpus():
    assert "xGMI" in codes(MI300, {"NCCL_P2P_DISABLE": "1"})["p2p-disabled-on-xgmi"].message
    assert "p2p-disabled-on-xgmi" not in codes(MI300, {"NCCL_P2P_DISABLE": "0"})
    radeon = {**MI300, "gpus": [{"index": 0, "name": "Radeon Pro W7800", "arch": "gfx1100", "memory_gib": 32.0}],
              "arch_list": ["gfx1100"], "driver": {**DRIVER_AMD, "kfd_gfx": ["gfx1100", "gfx1100"]}}
    assert "p2p-disabled-on-xgmi" not in codes(radeon, {"NCCL_P2P_DISABLE": "1"})


def test_sdma_disabled_and_gfx_override_and_cuda_home(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    found = codes(MI300, {"HSA_ENABLE_SDMA": "0", "HSA_OVERRIDE_GFX_VERSION": "11.0.0", "CUDA_HOME": str(tmp_path)})
    assert "DMA" in found["sdma-disabled"].message
    assert "unset it on supported" in found["gfx-override"].fix
    assert "bin/nvcc" in found["cuda-home-on-rocm"].message and "ROCM_PATH" in found["cuda-home-on-rocm"].fix
    assert "sdma-disabled" not in codes(MI300, {"HSA_ENABLE_SDMA": "1"})
    assert "cuda-home-on-rocm" not in codes(CPU_BOX, {"CUDA_HOME": str(tmp_path)})


def test_relevant_environment_picks_the_rocm_variables():
    env = {"HIP_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "INFO", "RCCL_MSCCL_ENABLE": "0", "HSA_NO_SCRATCH_RECLAIM": "1",
           "CUDA_VISIBLE_DEVICES": "0", "HOME": "/root", "PATH": "/bin", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert set(relevant_environment(env)) == set(env) - {"HOME", "PATH"}


def test_gfx_names_and_kfd_topology(tmp_path):
    assert devices.gfx_name(90402) == "gfx942" and devices.gfx_name(90010) == "gfx90a"
    assert devices.gfx_name(110000) == "gfx1100" and devices.gfx_name(0) is None
    for index, props in enumerate(["cpu_cores_count 64\ngfx_target_version 0\n",
                                   "simd_count 1216\ngfx_target_version 90402\n",
                                   "gfx_target_version 90010\n"]):
        (tmp_path / str(index)).mkdir()
        (tmp_path / str(index) / "properties").write_text(props)
    assert devices.kfd_gfx_targets(tmp_path) == ["gfx942", "gfx90a"]


def test_doctor_on_this_machine(tmp_path):
    report = tmp_path / "doctor.json"
    result = CliRunner().invoke(main, ["doctor", "--json", str(report)])
    document = json.loads(report.read_text())
    assert set(document) == {"versions", "environment", "deepspeed", "findings"}
    assert "DeepSpeed" in result.output
    errors = [f for f in document["findings"] if f["level"] == "error"]
    assert result.exit_code == (1 if errors else 0), result.output
    assert "versions and devices" in result.output and "environment" in result.output
    if document["versions"].get("torch"):
        assert document["versions"]["build"] in ("cpu", "cuda", "rocm")
    else:
        assert any(f["code"] == "torch-missing" for f in errors)


def test_the_report_says_whether_the_softmax_can_be_compiled_on_a_gpu():
    rows = dict(devices.summary_rows({**MI300, "triton": "3.4.0"}))
    assert rows["Triton"].startswith("3.4.0") and "compiled" in rows["Triton"]
    assert "eager path" in dict(devices.summary_rows({**MI300, "triton": None}))["Triton"]
    assert "Triton" not in dict(devices.summary_rows(CPU_BOX))  # a CPU build runs the eager path anyway


def test_deepspeed_row_lists_its_version_accelerator_and_ops():
    from megaport.commands.doctor import deepspeed_row

    status = {"version": "0.19.8", "accelerator": "cuda", "communication_backend": "nccl",
              "ops": {"fused_adam": {"installed": True, "compatible": True},
                      "cpu_adam": {"installed": False, "compatible": True},
                      "async_io": {"installed": False, "compatible": False}}}
    row = deepspeed_row(status)
    assert row.startswith("0.19.8 (accelerator cuda, backend nccl)")
    assert "ops prebuilt: fused_adam" in row and "built at run time if used: cpu_adam" in row
    assert "unavailable here: async_io" in row
    assert deepspeed_row(None).startswith("not installed")
    assert deepspeed_row({"error": "importing deepspeed failed: boom"}) == "importing deepspeed failed: boom"


def test_doctor_reports_deepspeed_in_its_json(tmp_path):
    import json

    from rich.console import Console

    from megaport.commands.doctor import doctor

    out = tmp_path / "doctor.json"
    status = {"version": "0.19.8", "accelerator": "cpu", "communication_backend": "gloo", "ops": {}}
    doctor(Console(file=open(tmp_path / "out.txt", "w")), json_file=str(out), environ={}, info={"torch": "2.13.0"},
           deepspeed_status=status)
    assert json.loads(out.read_text())["deepspeed"] == status
    assert "0.19.8 (accelerator cpu" in (tmp_path / "out.txt").read_text()


RDNA3 = {**MI300, "gpus": [{"index": 0, "name": "AMD Radeon RX 7900 XTX", "arch": "gfx1100", "memory_gib": 24.0}],
         "arch_list": ["gfx1100"], "driver": {**DRIVER_AMD, "kfd_gfx": ["gfx1100"]},
         "attention": {"gpu": {"flash": False, "efficient": False, "flash_error": "No available kernel."}}}


def test_rdna3_needs_aotritons_experimental_switch_for_flash_attention():
    found = codes(RDNA3)
    assert set(found) == {"aotriton-experimental-off"}
    assert "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in found["aotriton-experimental-off"].fix
    switched_on = {**RDNA3, "attention": {"gpu": {"flash": True, "efficient": True}}}
    assert codes(switched_on, {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"}) == {}


def test_a_gpu_without_fused_attention_kernels_is_named():
    no_kernels = {**MI300, "attention": {"gpu": {"flash": False, "efficient": False, "flash_error": "not built"}}}
    found = codes(no_kernels)
    assert set(found) == {"sdpa-math-only"} and "not built" in found["sdpa-math-only"].message
    assert codes({**MI300, "attention": {"gpu": {"flash": True, "efficient": True}}}) == {}


def test_the_report_names_the_attention_kernel_per_device():
    rows = dict(devices.summary_rows({**MI300, "attention": {"gpu": {"flash": False, "efficient": True},
                                                              "cpu": {"flash": True}}}))
    assert "memory-efficient" in rows["attention (GPU)"] and "flash" in rows["attention (CPU)"]


def test_this_machines_probe_runs_sdpa_on_the_cpu():
    info = devices.probe()
    if info.get("torch"):
        assert info["attention"]["cpu"]["flash"] is True, info["attention"]


def test_a_run_across_nodes_names_the_interfaces_and_rdma_nics_rccl_and_gloo_need():
    found = codes(MI300, {"MASTER_ADDR": "10.1.2.3"})
    assert {"nccl-socket-ifname-unset", "gloo-socket-ifname-unset", "nccl-ib-hca-unset"} <= set(found)
    assert "NCCL_IB_GID_INDEX=3" in found["nccl-ib-hca-unset"].fix
    ready = {"MASTER_ADDR": "10.1.2.3", "NCCL_SOCKET_IFNAME": "ens50f0np0", "GLOO_SOCKET_IFNAME": "ens50f0np0",
             "NCCL_IB_HCA": "rdma0:1,rdma1:1"}
    assert codes(MI300, ready) == {}
    assert codes(MI300, {**ready, "NCCL_SOCKET_IFNAME": "lo"})["nccl-socket-ifname-local"].level == "error"


def test_one_node_on_loopback_needs_no_interfaces():
    assert codes(MI300, {"MASTER_ADDR": "127.0.0.1"}) == {}
    assert codes(MI300, {"MASTER_ADDR": "localhost"}) == {}
