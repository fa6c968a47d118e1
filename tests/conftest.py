"""Shared fixtures: an isolated megaport cache, the PyPI-built upstream repo, fake CUDA modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Every release the integration tests use, asked for as ONE set so the shared cached repo is built
# once and never rebuilt in the middle of a session.
# All releases that install on Python 3.11 (0.17+ need 3.12): upstream's megatron/core at each tag.
CORE_TEST_RELEASES = [
    "0.5.0", "0.6.0", "0.7.0", "0.8.0", "0.9.0", "0.10.0", "0.11.0", "0.12.0", "0.12.1", "0.12.2",
    "0.12.3", "0.13.0", "0.13.1", "0.14.0", "0.15.0", "0.15.1", "0.15.2", "0.15.3", "0.16.0", "0.16.1",
]

FAKE_MODULES = (
    "apex", "amp_C", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
    "scaled_softmax_cuda", "fused_weight_gradient_mlp_cuda", "fused_layer_norm_cuda",
    "fused_mix_prec_layer_norm_cuda",
)


@pytest.fixture(autouse=True)
def isolated_megaport(tmp_path_factory, monkeypatch):
    """Keep tests away from the user's cache and catalogue settings."""
    home = tmp_path_factory.getbasetemp() / "megaport-home"
    monkeypatch.setenv("MEGAPORT_HOME", str(home))
    for name in ("MEGAPORT_PATCHES", "MEGAPORT_UPSTREAM"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def core_upstream() -> Path:
    """Local git repo of upstream megatron/core, one tagged commit per PyPI release."""
    from support.pypi_upstream import require_upstream

    return require_upstream(CORE_TEST_RELEASES)


@pytest.fixture(scope="session")
def core_upstream_py312() -> Path:
    """Local git repo of upstream megatron/core and megatron/training from the PyPI releases that
    need Python >= 3.12 (0.17 to 0.19); their trees import only on 3.12."""
    if sys.version_info < (3, 12):
        pytest.skip("megatron-core >= 0.17 needs Python 3.12 (typing.override); CI runs the tests on 3.12")
    from support.pypi_upstream import CORE_RELEASES_PY312, default_repo_dir_py312, require_upstream

    return require_upstream(CORE_RELEASES_PY312, dest=default_repo_dir_py312())


@pytest.fixture(scope="session")
def fake_cuda_modules(tmp_path_factory) -> Path:
    """Importable apex/amp_C/*_cuda stand-ins that crash if anything imports them."""
    root = tmp_path_factory.mktemp("fake-cuda-modules")
    for name in FAKE_MODULES:
        package = root / name
        package.mkdir()
        (package / "__init__.py").write_text(
            f"raise RuntimeError('{name} was imported: the ported tree must never load it')\n"
        )
    return root


def _clone_from_env(variable: str, what: str) -> Path:
    location = os.environ.get(variable)
    if not location:
        pytest.skip(f"set {variable} to a full {what} clone to run this")
    path = Path(location).expanduser()
    if not path.exists():
        pytest.skip(f"{variable}={location} does not exist")
    return path


@pytest.fixture(scope="session")
def full_clone() -> Path:
    """A full upstream clone named by MEGAPORT_UPSTREAM_CLONE, else skip."""
    return _clone_from_env("MEGAPORT_UPSTREAM_CLONE", "NVIDIA/Megatron-LM")


@pytest.fixture(scope="session")
def deepspeed_clone() -> Path:
    """A full microsoft/Megatron-DeepSpeed clone named by MEGAPORT_DEEPSPEED_CLONE, else skip."""
    return _clone_from_env("MEGAPORT_DEEPSPEED_CLONE", "microsoft/Megatron-DeepSpeed")
