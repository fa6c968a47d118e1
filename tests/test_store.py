"""megaport.store: the cache of upstream repositories, on local repositories only."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.gitrepos import bare_clone, branch, commit, git, make_repo, switch, tag

from megaport.errors import MegaportError
from megaport.git import is_dirty, is_shallow, rev_parse
from megaport.store import ResolvedRef, Store, default_home, normalize_url

CRLF = b"first line\r\nsecond line\r\n"
BINARY = bytes(range(256)) + b"\r\n\r\0"


@dataclasses.dataclass
class Upstream:
    path: Path
    first: str  # tagged v1.0 (lightweight)
    second: str  # tagged v2.0 (annotated); main is here
    dev: str  # branch dev, one commit past first


@pytest.fixture
def upstream(tmp_path: Path) -> Upstream:
    path = tmp_path / "Megatron-LM"
    first = make_repo(
        path,
        {"README.md": "# up\n", "crlf.txt": CRLF, "data/blob.bin": BINARY, "pkg/mod.py": "x = 1\n"},
        "first",
        tag="v1.0",
    )
    second = commit(path, {"pkg/mod.py": "x = 2\n", "pkg/new.py": "y\n"}, "second")
    tag(path, "v2.0", message="release 2.0")
    branch(path, "dev", first)
    switch(path, "dev")
    dev = commit(path, {"dev.txt": "dev\n"}, "on dev")
    switch(path, "main")
    return Upstream(path, first, second, dev)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


def cache_entries(store: Store) -> list[str]:
    """What is in <home>/repos, lock files aside."""
    if not store.repos_dir.exists():
        return []
    return sorted(p.name for p in store.repos_dir.iterdir() if not p.name.endswith(".lock"))


# -- resolving -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ref", "which"),
    [
        ("v1.0", "first"),  # lightweight tag
        ("v2.0", "second"),  # annotated tag: the commit, not the tag object
        ("main", "second"),
        ("dev", "dev"),
        ("refs/heads/dev", "dev"),
        ("refs/tags/v2.0", "second"),
        ("HEAD", "second"),
        ("FULL", "first"),
        ("ABBREV", "dev"),
    ],
)
def test_resolve_refs(store: Store, upstream: Upstream, ref: str, which: str) -> None:
    want = getattr(upstream, which)
    ref = {"FULL": upstream.first, "ABBREV": upstream.dev[:7]}.get(ref, ref)
    resolved = store.resolve(str(upstream.path), ref)
    assert resolved == ResolvedRef(str(upstream.path), ref, want, resolved.repo)
    assert resolved.repo.parent == store.repos_dir
    assert (resolved.repo / "HEAD").is_file() and not (resolved.repo / ".git").exists()  # bare
    assert rev_parse(resolved.repo, f"refs/megaport/pins/{want}") == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.sha = "x"  # type: ignore[misc]


def test_resolve_via_file_url_bare_repo_relative_and_home_paths(
    store: Store, upstream: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{upstream.path}"
    by_url = store.resolve(url, "v2.0")
    assert by_url.sha == upstream.second and by_url.url == url

    bare = bare_clone(upstream.path, tmp_path / "mirror" / "Megatron-LM.git")
    by_bare = store.resolve(str(bare), "dev")
    assert by_bare.sha == upstream.dev
    assert by_bare.repo.name.startswith("Megatron-LM-")

    monkeypatch.chdir(tmp_path)
    by_rel = store.resolve("Megatron-LM", "v1.0")
    assert by_rel.url == str(upstream.path) and by_rel.sha == upstream.first

    monkeypatch.setenv("HOME", str(tmp_path))
    by_home = store.resolve("~/Megatron-LM/", "main")
    assert by_home.url == str(upstream.path) and by_home.repo == by_rel.repo
    # one cache per URL: the path, file:// and the bare clone are three
    assert len({by_url.repo, by_bare.repo, by_rel.repo}) == 3


def test_cache_dir_name(store: Store, upstream: Upstream) -> None:
    resolved = store.resolve(str(upstream.path), "main")
    slug, digest = resolved.repo.name.rsplit("-", 1)
    assert slug == "Megatron-LM" and len(digest) == 12
    assert store.repo_path("https://github.com/NVIDIA/Megatron-LM.git").name.startswith(
        "Megatron-LM-"
    )
    assert store.repo_path("git@github.com:NVIDIA/Megatron-LM").name.startswith("Megatron-LM-")
    assert store.repo_path("https://a/x") != store.repo_path("https://b/x")


def test_normalize_url(tmp_path: Path) -> None:
    for url in (
        "https://github.com/NVIDIA/Megatron-LM.git",
        "ssh://git@github.com/NVIDIA/Megatron-LM",
        "git@github.com:NVIDIA/Megatron-LM.git",
        "git://example.com/x",
        "file:///does/not/matter",
    ):
        assert normalize_url(url) == url
    assert normalize_url(str(tmp_path) + "/") == str(tmp_path.resolve())
    with pytest.raises(MegaportError, match=r"^repository not found: .*give a git URL"):
        normalize_url(str(tmp_path / "nope"))


def test_tags_and_full_shas_need_no_network(
    store: Store, upstream: Upstream, tmp_path: Path
) -> None:
    url = str(upstream.path)
    store.resolve(url, "v2.0")
    store.resolve(url, "dev")
    gone = tmp_path / "gone"
    upstream.path.rename(gone)  # the "network" is down: any fetch would fail
    upstream.path.mkdir()  # (the path must exist to be taken as a local path)
    assert store.resolve(url, "v2.0").sha == upstream.second
    assert store.resolve(url, upstream.dev).sha == upstream.dev  # pinned by the branch resolve
    assert store.resolve(url, upstream.dev[:10]).sha == upstream.dev  # abbreviated, cached
    with pytest.raises(MegaportError, match=r"^cannot fetch .*; check the URL or your network$"):
        store.resolve(url, "dev")  # branches are always fetched


def test_branch_moves_are_picked_up(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    assert store.resolve(url, "main").sha == upstream.second
    third = commit(upstream.path, {"pkg/mod.py": "x = 3\n"}, "third")
    resolved = store.resolve(url, "main")
    assert resolved.sha == third
    # the previous tip stays reachable in the cache through its pin
    assert rev_parse(resolved.repo, f"refs/megaport/pins/{upstream.second}") == upstream.second
    # a force-push (history rewritten) too
    git(upstream.path, "reset", "--quiet", "--hard", upstream.first)
    assert store.resolve(url, "main").sha == upstream.first


def test_fetches_only_what_the_ref_needs(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    resolved = store.resolve(url, "main")
    assert is_shallow(resolved.repo)  # depth 1: just that commit
    assert rev_parse(resolved.repo, "refs/heads/dev") is None
    assert rev_parse(resolved.repo, f"{upstream.first}^{{commit}}") is None
    # an abbreviated sha that is not cached needs everything, and unshallows the cache
    assert store.resolve(url, upstream.first[:8]).sha == upstream.first
    assert not is_shallow(resolved.repo)
    assert rev_parse(resolved.repo, "refs/heads/dev") == upstream.dev
    # a complete cache stays complete when a branch moves
    third = commit(upstream.path, {"z.txt": "z\n"}, "third")
    assert store.resolve(url, "main").sha == third
    assert not is_shallow(resolved.repo)
    git(resolved.repo, "fsck", "--no-progress", "--connectivity-only")


def test_tag_is_fetched_when_not_cached(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    store.resolve(url, "main")
    tag(upstream.path, "v3.0", upstream.dev, message="three")
    assert store.resolve(url, "v3.0").sha == upstream.dev


def test_unknown_ref_is_one_line_error(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    store.resolve(url, "main")
    for ref in ("no-such-branch", "deadbeef", "0" * 40, "refs/heads/nope"):
        with pytest.raises(MegaportError) as info:
            store.resolve(url, ref)
        assert str(info.value) == (
            f"ref '{ref}' not found in {url}; try a tag, branch or commit sha that exists there"
        )
    for ref in ("", "-x", "a b", "main..dev", "v1^"):
        with pytest.raises(MegaportError, match="ref"):
            store.resolve(url, ref)


def test_unknown_ref_on_first_resolve(store: Store, upstream: Upstream) -> None:
    with pytest.raises(MegaportError, match="^ref 'nope' not found in "):
        store.resolve(str(upstream.path), "nope")
    assert cache_entries(store) == []  # nothing was fetched, nothing kept
    with pytest.raises(MegaportError, match="^ref 'abcdef12' not found in "):
        store.resolve(str(upstream.path), "abcdef12")
    # everything was fetched to look for the sha: that cache is worth keeping
    (kept,) = cache_entries(store)
    assert store.resolve(str(upstream.path), "dev").repo.name == kept


def test_missing_repository(store: Store, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(MegaportError) as info:
        store.resolve(str(missing), "main")
    assert str(info.value) == (
        f"repository not found: {missing} (give a git URL or the path of a clone)"
    )
    with pytest.raises(MegaportError) as info:
        store.resolve(f"file://{missing}", "main")
    message = str(info.value)
    assert message.startswith(f"cannot fetch file://{missing}: ")
    assert message.endswith("; check the URL or your network")
    assert "\n" not in message
    not_a_repo = tmp_path / "plain"
    not_a_repo.mkdir()
    with pytest.raises(MegaportError, match=r"^cannot fetch .*plain: "):
        store.resolve(str(not_a_repo), "0123456789" * 4)
    assert cache_entries(store) == []  # failed first fetches leave nothing behind


def test_unreachable_network_url_fails_fast(store: Store) -> None:
    # GIT_TERMINAL_PROMPT=0 and an unknown host: an error, never a prompt or a hang.
    start = time.monotonic()
    with pytest.raises(MegaportError, match=r"^cannot fetch https://.*; check the URL"):
        store.resolve("https://invalid.invalid/NVIDIA/Megatron-LM.git", "main", progress=False)
    assert time.monotonic() - start < 20
    assert cache_entries(store) == []


def test_interrupted_creation_leftovers_are_cleaned(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    name = store.repo_path(url).name
    leftover = store.repos_dir / f".{name}.tmp-killed"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("half made\n")
    store.resolve(url, "main")
    assert cache_entries(store) == [name]


def test_progress_forced_on(store: Store, upstream: Upstream) -> None:
    resolved = store.resolve(f"file://{upstream.path}", "dev", progress=True)
    assert resolved.sha == upstream.dev
    with pytest.raises(MegaportError, match="not found"):
        store.resolve(f"file://{upstream.path}", "nope", progress=True)


# -- homes -----------------------------------------------------------------------------
def test_default_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.delenv("MEGAPORT_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_home() == tmp_path / "user" / ".cache" / "megaport"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_home() == tmp_path / "user" / ".cache" / "megaport"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_home() == tmp_path / "xdg" / "megaport"
    monkeypatch.setenv("MEGAPORT_HOME", str(tmp_path / "mp"))
    assert default_home() == tmp_path / "mp"
    assert Store().home == tmp_path / "mp"


def test_store_honours_megaport_home_and_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream: Upstream
) -> None:
    monkeypatch.delenv("MEGAPORT_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    resolved = Store().resolve(str(upstream.path), "v1.0")
    assert resolved.repo.parent == tmp_path / "xdg" / "megaport" / "repos"
    monkeypatch.setenv("MEGAPORT_HOME", str(tmp_path / "mp"))
    resolved = Store().resolve(str(upstream.path), "v1.0")
    assert resolved.repo.parent == tmp_path / "mp" / "repos"


# -- concurrency -----------------------------------------------------------------------
def _resolve_in_child(home: str, url: str, ref: str) -> str:
    return Store(Path(home)).resolve(url, ref).sha


def test_concurrent_processes_share_one_cache(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    refs = ["main", "dev", "v1.0", upstream.first[:8]]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(len(refs)) as pool:
        shas = pool.starmap(_resolve_in_child, [(str(store.home), url, r) for r in refs])
    assert shas == [upstream.second, upstream.dev, upstream.first, upstream.first]
    (name,) = cache_entries(store)
    git(store.repos_dir / name, "fsck", "--no-progress")


def test_concurrent_threads(store: Store, upstream: Upstream) -> None:
    url = f"file://{upstream.path}"
    refs = ["main", "dev", "v2.0", upstream.first, "main", "dev"]
    with ThreadPoolExecutor(len(refs)) as pool:
        results = list(pool.map(lambda r: Store(store.home).resolve(url, r), refs))
    assert [r.sha for r in results] == [
        upstream.second, upstream.dev, upstream.second, upstream.first, upstream.second,
        upstream.dev,
    ]  # fmt: skip
    assert len({r.repo for r in results}) == 1


def test_lock_serialises_access(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    repo = store.repo_path(url)
    done = threading.Event()

    def resolve() -> None:
        store.resolve(url, "main")
        done.set()

    with store._locked(repo):
        worker = threading.Thread(target=resolve)
        worker.start()
        assert not done.wait(0.5)  # blocked on the lock
    worker.join(10)
    assert done.is_set()


# -- checkout_to -----------------------------------------------------------------------
def _check_work_repo(dest: Path, resolved: ResolvedRef, branch_name: str) -> None:
    assert (dest / ".git").is_dir()
    assert (dest / "crlf.txt").read_bytes() == CRLF
    assert (dest / "data" / "blob.bin").read_bytes() == BINARY
    assert git(dest, "symbolic-ref", "HEAD") == f"refs/heads/{branch_name}"
    assert git(dest, "rev-parse", "HEAD") == resolved.sha
    assert git(dest, "rev-parse", "refs/megaport/upstream") == resolved.sha
    assert git(dest, "remote", "get-url", "origin") == resolved.url
    assert git(dest, "config", "core.autocrlf") == "false"
    assert not is_dirty(dest)
    git(dest, "fsck", "--no-progress")


def test_checkout_from_shallow_cache(store: Store, upstream: Upstream, tmp_path: Path) -> None:
    resolved = store.resolve(str(upstream.path), "main")
    assert is_shallow(resolved.repo)
    dest = tmp_path / "work" / "megatron"
    store.checkout_to(resolved, dest, "rocm-port")
    _check_work_repo(dest, resolved, "rocm-port")
    assert (dest / "pkg" / "new.py").read_bytes() == b"y\n"
    # it is a normal repository: commit in it
    (dest / "pkg" / "mod.py").write_text("x = 'rocm'\n")
    assert is_dirty(dest)
    git(dest, "commit", "--quiet", "-am", "port")
    assert git(dest, "rev-parse", "HEAD~1") == resolved.sha


def test_checkout_from_full_cache(store: Store, upstream: Upstream, tmp_path: Path) -> None:
    resolved = store.resolve(str(upstream.path), upstream.first[:7])
    assert not is_shallow(resolved.repo)
    dest = tmp_path / "work"
    store.checkout_to(resolved, dest, "port")
    _check_work_repo(dest, resolved, "port")
    assert not (dest / "pkg" / "new.py").exists()
    assert git(dest, "log", "--format=%s") == "first"
    # independent of the cache: it keeps working once the cache is gone
    shutil.rmtree(store.home)
    git(dest, "fsck", "--no-progress")
    assert (dest / "crlf.txt").read_bytes() == CRLF


def test_checkout_to_refuses_existing_dest_and_bad_branch(
    store: Store, upstream: Upstream, tmp_path: Path
) -> None:
    resolved = store.resolve(str(upstream.path), "main")
    existing = tmp_path / "exists"
    existing.mkdir()
    with pytest.raises(MegaportError, match="^destination already exists: "):
        store.checkout_to(resolved, existing, "port")
    with pytest.raises(MegaportError, match="^invalid branch name"):
        store.checkout_to(resolved, tmp_path / "new", "bad..name")
    assert not (tmp_path / "new").exists()
    bogus = dataclasses.replace(resolved, sha="1" * 40)
    with pytest.raises(MegaportError, match="not in the cache"):
        store.checkout_to(bogus, tmp_path / "new", "port")
    assert not (tmp_path / "new").exists()  # nothing half-made left


def test_checkout_preserves_crlf_despite_user_autocrlf(
    store: Store, upstream: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text("[core]\n\tautocrlf = true\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
    resolved = store.resolve(str(upstream.path), "v1.0")
    dest = tmp_path / "w"
    store.checkout_to(resolved, dest, "port")
    assert (dest / "crlf.txt").read_bytes() == CRLF
    assert (dest / "README.md").read_bytes() == b"# up\n"
    out = subprocess.run(
        ["git", "status", "--porcelain"], cwd=dest, capture_output=True, text=True, check=True
    ).stdout
    assert out == ""
    assert os.environ["GIT_CONFIG_GLOBAL"] == str(gitconfig)


def test_checkout_origin_url_with_odd_characters(store: Store, tmp_path: Path) -> None:
    odd = tmp_path / 'we"ird\\dir #1;x' / "Megatron-LM"
    sha = make_repo(odd, {"a.txt": "a\n"})
    resolved = store.resolve(str(odd), "main")
    assert resolved.sha == sha
    dest = tmp_path / "w"
    store.checkout_to(resolved, dest, "port")
    assert git(dest, "remote", "get-url", "origin") == str(odd)
    assert git(dest, "config", "core.autocrlf") == "false"


def test_name_that_is_both_branch_and_tag_is_the_branch(store: Store, upstream: Upstream) -> None:
    url = str(upstream.path)
    tag(upstream.path, "both", upstream.first)
    branch(upstream.path, "both", upstream.dev)
    assert store.resolve(url, "both").sha == upstream.dev
    store.resolve(url, upstream.first[:8])  # full fetch: the tag "both" is cached now
    assert store.resolve(url, "both").sha == upstream.dev
    git(upstream.path, "branch", "-f", "both", upstream.second)
    assert store.resolve(url, "both").sha == upstream.second


def test_init_from_cache_then_check_out(store: Store, upstream: Upstream, tmp_path: Path) -> None:
    resolved = store.resolve(str(upstream.path), "v2.0")
    dest = tmp_path / "tmp-sibling"
    dest.mkdir()  # an empty directory is accepted (e.g. made by mkdtemp)
    store.init_from_cache(resolved, dest)
    assert sorted(p.name for p in dest.iterdir()) == [".git"]  # nothing checked out
    assert git(dest, "rev-parse", "refs/megaport/upstream") == upstream.second
    assert git(dest, "remote", "get-url", "origin") == resolved.url
    # write a commit on a branch without touching the work tree, then check it out
    tree = git(dest, "rev-parse", f"{upstream.second}^{{tree}}")
    child = git(dest, "commit-tree", tree, "-p", upstream.second, "-m", "port")
    git(dest, "update-ref", "refs/heads/port", child)
    store.check_out(dest, "port")
    assert git(dest, "symbolic-ref", "HEAD") == "refs/heads/port"
    assert (dest / "crlf.txt").read_bytes() == CRLF
    assert not is_dirty(dest)

    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x\n")
    with pytest.raises(MegaportError, match="^destination already exists"):
        store.init_from_cache(resolved, full)
    assert (full / "x").exists()
    missing = dataclasses.replace(resolved, sha="2" * 40)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MegaportError, match="not in the cache"):
        store.init_from_cache(missing, empty)
    assert empty.is_dir() and not any(empty.iterdir())  # the user's directory is kept, emptied
