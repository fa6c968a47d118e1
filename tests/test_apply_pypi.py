"""End to end on real upstream code: `megaport apply` on trees built from PyPI megatron-core.

Each release is ported as a user would (the CLI, a local upstream repo, automatic selection),
then imported in a fresh interpreter with apex/amp_C/*_cuda stand-ins on the path that crash if
loaded, and its softmax functions are compared with an fp64 reference of that era's kernels.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner
from conftest import CORE_TEST_RELEASES
from support.porting import assert_clean, assert_kernel_semantics, check_tree, port, semantics_of

from megaport.catalogue import load_catalogue
from megaport.cli import main

pytestmark = pytest.mark.upstream


def series_listing(tag: str) -> str | None:
    for series in load_catalogue().series:
        if tag in {t.ref for t in series.tested}:
            return series.name
    return None


def test_every_pypi_release_is_listed_by_a_series():
    missing = [v for v in CORE_TEST_RELEASES if series_listing(f"core_v{v}") is None]
    assert not missing, f"no series lists these releases as tested: {missing}"


@pytest.fixture(scope="module", params=[v for v in CORE_TEST_RELEASES if series_listing(f"core_v{v}")])
def ported(request, tmp_path_factory, core_upstream):
    version = request.param
    dest = tmp_path_factory.mktemp("ported") / f"megatron-{version}"
    code, report, output = port(core_upstream, f"core_v{version}", dest)
    assert code == 0, output
    return version, dest, report


def test_the_listed_series_is_chosen_and_applies_without_fuzz(ported):
    version, _, report = ported
    assert report["series"] == series_listing(f"core_v{version}")
    assert f"megatron/core {version}" in report["reason"]
    assert_clean(report)
    # PyPI ships megatron/core only: patches for other folders (megatron/training, the converter
    # under tools/checkpoint) have nothing to change.
    for patch in report["patches"]:
        if patch["status"] == "skipped":
            assert patch["reason"].startswith(("tree has no megatron/", "tree has no tools/checkpoint"))


def test_each_patch_is_a_commit_on_the_series_branch(ported):
    _, dest, report = ported
    git = lambda *a: subprocess.run(["git", *a], cwd=dest, capture_output=True, text=True).stdout  # noqa: E731
    assert git("branch", "--show-current").strip() == f"megaport/{report['series']}"
    log = git("log", "--format=%s", "refs/megaport/upstream..HEAD").splitlines()
    assert len(log) == sum(1 for p in report["patches"] if p["status"] == "applied")
    assert git("status", "--porcelain") == ""


def test_ported_modules_import_without_apex_and_match_the_kernels(ported, fake_cuda_modules):
    pytest.importorskip("torch")
    version, dest, report = ported
    semantics = semantics_of(report["series"])
    found = check_tree(dest, fake_cuda_modules, semantics)
    imported = {name.rsplit(".", 1)[-1] for name in found["imported"]}
    assert {"rocm_port", "fused_softmax", "layers"} <= imported
    if version != "0.5.0":  # megatron/core/optimizer arrived in 0.6.0
        assert "optimizer" in imported
    assert_kernel_semantics(found, semantics)


def test_rerun_is_a_noop(ported, core_upstream):
    version, dest, _ = ported
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=dest, capture_output=True, text=True).stdout
    code, _, output = port(core_upstream, f"core_v{version}", dest)
    assert code == 0 and "nothing to do" in output
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=dest, capture_output=True, text=True).stdout == head


def test_status_reports_the_port_offline(ported):
    version, dest, report = ported
    result = CliRunner().invoke(main, ["status", str(dest), "--json", "-"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["series"] == report["series"]
    assert document["upstream"]["ref"] == f"core_v{version}"
    assert document["changed_files"] == []
