"""Tests for tests/support/pypi_upstream.py: the upstream repository built from PyPI releases."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

try:  # repo root on sys.path (PYTHONPATH=. or python -m pytest)
    from tests.support import pypi_upstream as pu
except ImportError:  # plain `pytest`: tests/ itself is on sys.path
    from support import pypi_upstream as pu

VERSIONS = ["0.13.0", "0.14.0", "0.16.1"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, stdout=subprocess.PIPE, text=True
    ).stdout


def git_bytes(repo: Path, *args: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, stdout=subprocess.PIPE
    ).stdout


def ref_shas(repo: Path) -> str:
    return git(repo, "for-each-ref", "--format=%(objectname) %(refname)", "refs/heads", "refs/tags")


@pytest.fixture(scope="module")
def upstream_repo() -> Path:
    return pu.require_upstream(VERSIONS)


# ---------------------------------------------------------------- no network needed


def test_tag_names():
    assert pu.tag_for("0.13.0") == "core_v0.13.0"
    assert pu.version_for_tag("core_v0.16.1") == "0.16.1"
    assert pu.version_for_tag("v0.16.1") is None


def test_core_releases_are_ordered_and_unique():
    assert pu.CORE_RELEASES == pu.sort_versions(pu.CORE_RELEASES)
    assert pu.sort_versions(["0.10.0", "0.9.0", "0.12.3", "0.12.0", "0.9.0"]) == [
        "0.9.0", "0.10.0", "0.12.0", "0.12.3",
    ]


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAPORT_TEST_CACHE", str(tmp_path / "c"))
    assert pu.cache_dir() == tmp_path / "c"
    assert pu.default_repo_dir() == tmp_path / "c" / "upstream-core"
    monkeypatch.delenv("MEGAPORT_TEST_CACHE")
    assert pu.cache_dir() == Path.home() / ".cache" / "megaport-tests"


def test_offline_without_cache_skips(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAPORT_TEST_CACHE", str(tmp_path))
    monkeypatch.setenv("MEGAPORT_TEST_OFFLINE", "1")
    assert not pu.release_available("0.13.0")
    reason = pu.unavailable_reason(["0.13.0"])
    assert reason and "\n" not in reason
    with pytest.raises(pytest.skip.Exception, match="0.13.0"):
        pu.require_upstream(["0.13.0"])


def test_unreachable_registry_skips_with_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAPORT_TEST_CACHE", str(tmp_path))
    monkeypatch.delenv("MEGAPORT_TEST_OFFLINE", raising=False)
    # Port 9 on localhost: connection refused at once, as with no network.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no extra indexes from pip.conf
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(pytest.skip.Exception) as info:
        pu.require_upstream(["0.13.0"])
    msg = str(info.value)
    assert "\n" not in msg and "registry" in msg
    assert not list((tmp_path / "dists").glob("*.whl"))
    assert not list((tmp_path / "dists").glob(".download-*"))  # temp folders cleaned up


def test_refuses_to_replace_a_foreign_folder(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "keep.txt").write_text("precious")
    # Refused before anything is downloaded, so this needs no network.
    with pytest.raises(pu.UpstreamBuildError, match="refusing"):
        pu.build_upstream_repo(["0.13.0"], dest=dest)
    assert (dest / "keep.txt").read_text() == "precious"


# ---------------------------------------------------------------- real releases


@pytest.mark.upstream
def test_repo_has_requested_tags_on_linear_main(upstream_repo):
    tags = set(git(upstream_repo, "tag", "--list").split())
    assert {pu.tag_for(v) for v in VERSIONS} <= tags
    # Linear history on main, one commit per release, in version order.
    lines = git(upstream_repo, "rev-list", "--parents", "--reverse", "main").splitlines()
    assert all(len(line.split()) <= 2 for line in lines)
    assert len(lines[0].split()) == 1  # root commit
    subjects = git(upstream_repo, "log", "--reverse", "--format=%s", "main").splitlines()
    built = [re.fullmatch(r"megatron-core (\S+) \(from PyPI\)", s).group(1) for s in subjects]
    assert built == pu.sort_versions(built)
    assert set(VERSIONS) <= set(built)
    for v in VERSIONS:
        assert git(upstream_repo, "rev-parse", f"{pu.tag_for(v)}^{{commit}}").strip() in {
            line.split()[0] for line in lines
        }
    # main is checked out at the newest release, with a clean work tree.
    assert git(upstream_repo, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert git(upstream_repo, "status", "--porcelain") == ""
    newest = built[-1]
    assert git(upstream_repo, "rev-parse", "HEAD") == git(upstream_repo, "rev-parse", f"{pu.tag_for(newest)}^{{commit}}")


@pytest.mark.upstream
@pytest.mark.parametrize("version", VERSIONS)
def test_package_info_matches_tag(upstream_repo, version):
    text = git(upstream_repo, "show", f"{pu.tag_for(version)}:megatron/core/package_info.py")
    major, minor, patch = (int(x) for x in version.split("."))
    assert re.search(rf"^MAJOR\s*=\s*{major}\s*$", text, re.M)
    assert re.search(rf"^MINOR\s*=\s*{minor}\s*$", text, re.M)
    assert re.search(rf"^PATCH\s*=\s*{patch}\s*$", text, re.M)


@pytest.mark.upstream
def test_core_v0_13_0_reports_minor_13(upstream_repo):
    text = git(upstream_repo, "show", "core_v0.13.0:megatron/core/package_info.py")
    assert re.search(r"^MINOR\s*=\s*13\s*$", text, re.M)


@pytest.mark.upstream
def test_rebuild_is_a_fast_no_op(upstream_repo):
    before = ref_shas(upstream_repo)
    head = git(upstream_repo, "rev-parse", "HEAD")
    start = time.monotonic()
    again = pu.build_upstream_repo(VERSIONS)
    elapsed = time.monotonic() - start
    assert again == upstream_repo
    assert elapsed < 0.5, f"fast path took {elapsed:.3f}s"
    assert git(again, "rev-parse", "HEAD") == head
    assert ref_shas(again) == before
    # A subset of what is there is also served by the fast path.
    start = time.monotonic()
    assert pu.build_upstream_repo(VERSIONS[:1]) == upstream_repo
    assert time.monotonic() - start < 0.5
    assert ref_shas(upstream_repo) == before


@pytest.mark.upstream
def test_shas_are_stable_across_destinations(upstream_repo, tmp_path):
    a = pu.require_upstream(VERSIONS, dest=tmp_path / "a")
    b = pu.require_upstream(list(reversed(VERSIONS)), dest=tmp_path / "b" / "nested")
    assert a != b
    assert ref_shas(a) == ref_shas(b)
    assert git(a, "rev-parse", "HEAD") == git(b, "rev-parse", "HEAD")
    # Fixed identity and dates: nothing depends on the machine or the clock.
    log = git(a, "log", "--format=%an|%ae|%at|%cn|%ce|%ct|%s", "main").splitlines()
    for line in log:
        an, ae, at, cn, ce, ct, subject = line.split("|")
        assert (an, ae, at) == (cn, ce, ct)
        assert an == pu.GIT_NAME and ae == pu.GIT_EMAIL
        version = re.fullmatch(r"megatron-core (\S+) \(from PyPI\)", subject).group(1)
        assert int(at) == pu._commit_timestamp(version)
    assert git(a, "config", "core.autocrlf").strip() == "false"


@pytest.mark.upstream
@pytest.mark.parametrize("version", VERSIONS)
def test_tree_is_exactly_the_release(upstream_repo, version):
    files = pu.read_release_files(pu.download_release(version))
    assert "megatron/core/package_info.py" in files
    assert not [p for p in files if p.endswith((".so", ".pyd")) or "__pycache__" in p]
    listing = git(upstream_repo, "ls-tree", "-r", "--full-tree", pu.tag_for(version)).splitlines()
    tree = {}
    for line in listing:
        meta, path = line.split("\t", 1)
        mode, kind, sha = meta.split()
        assert (mode, kind) == ("100644", "blob")
        tree[path] = sha
    # Same file set (so files deleted between releases are gone) and same bytes.
    assert sorted(tree) == sorted(files)
    assert {p: pu.git_blob_sha(data) for p, data in files.items()} == tree


@pytest.mark.upstream
def test_file_bytes_identical_to_wheel(upstream_repo):
    import zipfile

    dist = pu.download_release("0.13.0")
    path = "megatron/core/tensor_parallel/layers.py"
    if dist.name.endswith(".whl"):
        with zipfile.ZipFile(dist) as z:
            shipped = z.read(path)
    else:
        shipped = pu.read_release_files(dist)[path]
    assert git_bytes(upstream_repo, "cat-file", "blob", f"core_v0.13.0:{path}") == shipped
    # The work tree is the newest release, byte for byte (no newline conversion).
    newest = pu.sort_versions(VERSIONS)[-1]
    newest_files = pu.read_release_files(pu.download_release(newest))
    assert (upstream_repo / path).read_bytes() == newest_files[path]
