"""megaport.git (and megaport.progress): the git helpers, on throwaway local repositories."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress
from support.gitrepos import bare_clone, branch, commit, git, make_repo, tag

from megaport.errors import MegaportError
from megaport.git import (
    BlobReader,
    GitError,
    ObjectReader,
    changed_files,
    checkout_branch,
    fast_import,
    first_parent,
    git_env,
    git_reason,
    has_commit,
    is_ancestor,
    is_dirty,
    is_shallow,
    list_refs,
    ls_tree_paths,
    merge_file,
    renamed_paths,
    rev_parse,
    run_git,
    stream_git,
)
from megaport.progress import RichProgress, run_git_with_progress

BINARY = bytes(range(256)) * 4 + b"\r\n\0\r"
FILES = {
    "README.md": "# upstream\n",
    "crlf.txt": b"line one\r\nline two\r\n",
    "data/blob.bin": BINARY,
    "pkg/__init__.py": "",
    "pkg/core/mod.py": "x = 1\n",
    "pkg/core/util.py": "y = 2\n",
    "caf\u00e9.txt": "unicode name\n",
}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    make_repo(path, FILES, tag="v1")
    commit(path, {"README.md": "# upstream v2\n"}, "second", delete=["pkg/core/util.py"])
    return path


# -- run_git / errors ------------------------------------------------------------------
def test_run_git_returns_output(repo: Path) -> None:
    proc = run_git(["rev-parse", "HEAD"], repo)
    assert proc.returncode == 0
    assert len(proc.stdout.strip()) == 40


def test_run_git_raises_one_line_megaport_error(repo: Path) -> None:
    with pytest.raises(GitError) as info:
        run_git(["rev-parse", "--verify", "no-such-ref"], repo)
    err = info.value
    assert isinstance(err, MegaportError)
    assert "\n" not in str(err)
    assert str(err).startswith("git rev-parse failed: ")
    assert err.returncode != 0
    assert err.exit_code == 1


def test_run_git_check_false_and_bytes(repo: Path) -> None:
    assert run_git(["rev-parse", "--verify", "nope"], repo, check=False).returncode != 0
    proc = run_git(["cat-file", "blob", "HEAD:data/blob.bin"], repo, text=False)
    assert proc.stdout == BINARY


def test_run_git_input_and_env(repo: Path) -> None:
    proc = run_git(["hash-object", "--stdin"], repo, input="abc")
    assert proc.stdout.strip() == "f2ba8f84ab5c1bce84a7b441cb1959cfc7093b7f"
    proc = run_git(["var", "GIT_AUTHOR_IDENT"], repo, env={"GIT_AUTHOR_NAME": "Zed"})
    assert proc.stdout.startswith("Zed ")


def test_git_env_drops_repository_variables(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As inside a git hook: GIT_DIR would otherwise point every command at another repo.
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(tmp_path / "index"))
    monkeypatch.setenv("GIT_SSH_COMMAND", "ssh -v")
    env = git_env()
    assert "GIT_DIR" not in env and "GIT_INDEX_FILE" not in env
    assert env["GIT_SSH_COMMAND"] == "ssh -v"
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    assert rev_parse(repo, "HEAD") is not None


def test_missing_cwd_is_a_git_error(tmp_path: Path) -> None:
    with pytest.raises(GitError, match="directory not found"):
        run_git(["status"], tmp_path / "missing")


@pytest.mark.parametrize(
    ("stderr", "reason"),
    [
        ("fatal: couldn't find remote ref refs/heads/x\n", "couldn't find remote ref refs/heads/x"),
        (
            "fatal: '/x' does not appear to be a git repository\n"
            "fatal: Could not read from remote repository.\n\n"
            "Please make sure you have the correct access rights\nand the repository exists.\n",
            "'/x' does not appear to be a git repository",
        ),
        (
            "git@github.com: Permission denied (publickey).\r\n"
            "fatal: Could not read from remote repository.\n",
            "git@github.com: Permission denied (publickey).",
        ),
        ("remote: Repository not found.\nfatal: repository 'https://h/x/' not found\n",
         "repository 'https://h/x/' not found"),
        ("warning: something\n", "warning: something"),
        ("", ""),
    ],
)
def test_git_reason(stderr: str, reason: str) -> None:
    assert git_reason(stderr) == reason


# -- queries ---------------------------------------------------------------------------
def test_rev_parse(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    assert rev_parse(repo, "HEAD") == head
    assert rev_parse(repo, head[:8]) == head
    assert rev_parse(repo, "v1") == git(repo, "rev-parse", "HEAD~1")
    assert rev_parse(repo, "missing") is None
    assert rev_parse(repo, "--all") is None
    assert rev_parse(repo, "") is None


def test_has_commit_and_is_ancestor(repo: Path) -> None:
    first, second = git(repo, "rev-parse", "HEAD~1"), git(repo, "rev-parse", "HEAD")
    assert has_commit(repo, first) and has_commit(repo, second[:10])
    assert not has_commit(repo, "0" * 40)
    tree = git(repo, "rev-parse", "HEAD^{tree}")
    assert not has_commit(repo, tree)
    assert is_ancestor(repo, first, second)
    assert is_ancestor(repo, second, second)
    assert not is_ancestor(repo, second, first)
    with pytest.raises(GitError):
        is_ancestor(repo, "0" * 40, second)


def test_is_shallow(repo: Path, tmp_path: Path) -> None:
    assert not is_shallow(repo)
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "--quiet", "--depth=1", f"file://{repo}", str(shallow))
    assert is_shallow(shallow)
    assert is_shallow(shallow / "pkg")  # from a subdirectory too


def test_is_dirty(repo: Path) -> None:
    assert not is_dirty(repo)
    (repo / ".gitignore").write_text("*.log\n")
    assert is_dirty(repo)  # untracked
    commit(repo, {}, "ignore logs")
    (repo / "build.log").write_text("ignored\n")
    assert not is_dirty(repo)  # ignored files do not count
    (repo / "crlf.txt").write_bytes(b"line one\nline two\n")  # only line endings change
    assert is_dirty(repo)
    git(repo, "checkout", "--", "crlf.txt")
    assert not is_dirty(repo)
    (repo / "README.md").write_text("staged\n")
    git(repo, "add", "README.md")
    assert is_dirty(repo)


def test_ls_tree_paths(repo: Path) -> None:
    first = git(repo, "rev-parse", "HEAD~1")
    assert ls_tree_paths(repo, first) == sorted(FILES, key=lambda p: p.encode())
    assert ls_tree_paths(repo, first, "pkg/core") == ["pkg/core/mod.py", "pkg/core/util.py"]
    assert ls_tree_paths(repo, first, "pkg/core/") == ["pkg/core/mod.py", "pkg/core/util.py"]
    assert ls_tree_paths(repo, "HEAD", "pkg/core") == ["pkg/core/mod.py"]
    assert ls_tree_paths(repo, first, "pkg/co") == []
    assert ls_tree_paths(repo, first, "crlf.txt") == ["crlf.txt"]
    with (repo / "pkg").joinpath("x").open("w"):
        pass
    # independent of the working directory inside the repository
    assert ls_tree_paths(repo / "pkg", first, "pkg/core") == ["pkg/core/mod.py", "pkg/core/util.py"]


def test_is_shallow_outside_a_repository(tmp_path: Path) -> None:
    with pytest.raises(GitError, match="not a git repository"):
        is_shallow(tmp_path)


def test_list_refs_peels_annotated_tags_and_skips_what_is_not_a_commit(repo: Path) -> None:
    first, second = git(repo, "rev-parse", "HEAD~1"), git(repo, "rev-parse", "HEAD")
    tag(repo, "v1.10", second, message="annotated")
    tag(repo, "v1.9", first)
    git(repo, "tag", "tree-tag", git(repo, "rev-parse", "HEAD^{tree}"))
    assert list_refs(repo, ["refs/tags/"], sort="version:refname") == [
        ("refs/tags/v1", first), ("refs/tags/v1.9", first), ("refs/tags/v1.10", second),
    ]  # fmt: skip
    # several patterns at once; a pattern is a full name or a prefix ending at a "/"
    assert dict(list_refs(repo, ["refs/heads/main", "refs/tags/v1.1", "refs/tags/v1.10"])) == {
        "refs/heads/main": second, "refs/tags/v1.10": second,
    }  # fmt: skip
    assert list_refs(repo, ["refs/megaport/"]) == []


def test_first_parent(repo: Path) -> None:
    first, second = git(repo, "rev-parse", "HEAD~1"), git(repo, "rev-parse", "HEAD")
    branch(repo, "side", first)
    assert first_parent(repo, "main") == [second, first]
    assert first_parent(repo, "main", count=1) == [second]
    assert first_parent(repo, "main", exclude="side") == [second]
    with pytest.raises(GitError):
        first_parent(repo, "no-such-branch")


def test_renamed_paths_and_changed_files(repo: Path) -> None:
    before = git(repo, "rev-parse", "HEAD")
    git(repo, "mv", "pkg/core/mod.py", "pkg/moved.py")
    after = commit(repo, {}, "move", delete=["crlf.txt"])
    assert renamed_paths(repo, before, after) == {"pkg/core/mod.py": "pkg/moved.py", "crlf.txt": None}
    assert renamed_paths(repo, after, after) == {}
    assert changed_files(repo, after, ["README.md", "pkg/moved.py"]) == []
    (repo / "pkg/moved.py").write_text("x = 2\n")
    assert changed_files(repo, after, ["README.md", "pkg/moved.py"]) == ["pkg/moved.py"]
    assert changed_files(repo, before, ["README.md", "pkg"]) == ["pkg/core/mod.py", "pkg/moved.py"]


def test_merge_file() -> None:
    base = b"a\nb\nc\nd\ne\n"
    assert merge_file(b"A\nb\nc\nd\ne\n", base, b"a\nb\nc\nd\nE\n") == (b"A\nb\nc\nd\nE\n", 0)
    assert merge_file(b"a\nX\nc\nd\ne\n", base, b"a\nY\nc\nd\ne\n") == (None, 1)


def test_fast_import_returns_the_marked_commits(repo: Path) -> None:
    parent = git(repo, "rev-parse", "HEAD")
    stream = (f"reset refs/heads/port\nfrom {parent}\n\n".encode()
              + b"commit refs/heads/port\nmark :1\ncommitter A <a@b> 0 +0000\ndata 3\none\n"
              + b"M 100755 inline run.sh\ndata 3\nx\r\n\n"
              + b"commit refs/heads/port\nmark :2\ncommitter A <a@b> 0 +0000\ndata 3\ntwo\n"
              + b"D README.md\n\n")  # fmt: skip
    marks = fast_import(repo, stream)
    assert list(marks) == [":1", ":2"]
    assert git(repo, "rev-parse", "port") == marks[":2"]
    assert git(repo, "rev-parse", "port~1") == marks[":1"] and git(repo, "rev-parse", "port~2") == parent
    assert fast_import(repo, f"reset refs/heads/same\nfrom {parent}\n\n".encode()) == {}
    assert git(repo, "rev-parse", "same") == parent
    with pytest.raises(GitError, match="fast-import"):
        fast_import(repo, b"commit refs/heads/bad\nnonsense\n")
    # a switch to the branch writes its files, modes and bytes as committed
    checkout_branch(repo, "port")
    assert (repo / "run.sh").read_bytes() == b"x\r\n" and os.access(repo / "run.sh", os.X_OK)
    assert not (repo / "README.md").exists() and not is_dirty(repo)
    assert git(repo, "symbolic-ref", "HEAD") == "refs/heads/port"
    (repo / "run.sh").write_bytes(b"local change\n")  # main has no run.sh
    with pytest.raises(GitError, match="local changes"):  # never over local changes
        checkout_branch(repo, "main")
    assert (repo / "run.sh").read_bytes() == b"local change\n"


def test_stream_git_hands_over_lines_as_they_come(repo: Path) -> None:
    lines: list[str] = []
    code, out = stream_git(["rev-parse", "--verify", "HEAD", "nope"], repo, lines.append)
    assert code != 0 and out == ""
    assert lines and all("\n" not in line for line in lines)
    code, out = stream_git(["rev-parse", "HEAD"], repo, lines.append)
    assert code == 0 and out.strip() == git(repo, "rev-parse", "HEAD")


# -- BlobReader ------------------------------------------------------------------------
def test_blob_reader_reads_without_checkout(repo: Path, tmp_path: Path) -> None:
    bare = bare_clone(repo, tmp_path / "bare.git")
    first = git(repo, "rev-parse", "v1")
    with BlobReader(bare, "v1") as tree:
        assert tree.commit == first
        assert tree.read("README.md") == b"# upstream\n"
        assert tree.read("crlf.txt") == b"line one\r\nline two\r\n"
        assert tree.read("data/blob.bin") == BINARY
        assert tree.read("pkg/__init__.py") == b""
        assert tree.read("caf\u00e9.txt") == b"unicode name\n"
        assert tree.read("./pkg//core/mod.py") == b"x = 1\n"
        assert tree.read("missing.txt") is None
        assert tree.read("pkg/missing/mod.py") is None
        assert tree.read("pkg") is None  # a directory is not a file
        assert tree.exists("pkg/core/util.py") and tree.exists("pkg") and tree.exists("")
        assert not tree.exists("pkg/nope")
        assert tree.is_dir("pkg/core") and not tree.is_dir("README.md")
        assert tree.list_dir("") == ["README.md", "caf\u00e9.txt", "crlf.txt", "data", "pkg"]
        assert tree.list_dir("pkg") == ["__init__.py", "core"]
        assert tree.list_dir("README.md") is None
        assert tree.list_dir("nope") is None
        pid = tree.objects.process_id  # one long-lived process serves every read
        assert pid is not None
        for _ in range(50):
            tree.read("pkg/core/mod.py")
        assert tree.objects.process_id == pid
    with pytest.raises(ValueError):
        tree.read("README.md")
    with BlobReader(repo, "HEAD") as head:
        assert head.read("pkg/core/util.py") is None
        assert head.read("README.md") == b"# upstream v2\n"
    # nothing was checked out of the bare repository
    assert not (bare / "README.md").exists()


def test_blob_reader_large_file_and_many_reads(tmp_path: Path) -> None:
    big = bytes(range(256)) * 8192  # 2 MiB, more than any pipe buffer
    path = tmp_path / "r"
    files = {f"f{i}.txt": f"{i}\n" for i in range(300)}
    make_repo(path, {**files, "big.bin": big})
    with BlobReader(path, "HEAD") as tree:
        assert tree.read("big.bin") == big
        for i in range(300):
            assert tree.read(f"f{i}.txt") == f"{i}\n".encode()
        assert len(tree.list_dir("")) == 301


def test_blob_reader_submodule_entry(tmp_path: Path) -> None:
    path = tmp_path / "r"
    make_repo(path, {"a.txt": "a\n"})
    sub = "1" * 40
    git(path, "update-index", "--add", "--cacheinfo", f"160000,{sub},third_party/sub")
    git(path, "commit", "--quiet", "-m", "add submodule")
    with BlobReader(path, "HEAD") as tree:
        assert tree.exists("third_party/sub")
        assert tree.read("third_party/sub") is None
        assert tree.list_dir("third_party") == ["sub"]


def test_commits_sharing_directories_ask_git_only_for_what_changed(repo: Path, monkeypatch) -> None:
    """Drift reads the same files of thousands of commits: an unchanged directory or file is
    asked of git once, whichever commit it is read through."""
    asked: list[str] = []
    original = ObjectReader.get

    def counting(self, name):
        asked.append(name)
        return original(self, name)

    monkeypatch.setattr(ObjectReader, "get", counting)
    with ObjectReader(repo) as objects:
        first, second = objects.tree("v1"), objects.tree("HEAD")
        assert first.read("pkg/core/mod.py") == second.read("pkg/core/mod.py") == b"x = 1\n"
        assert first.read("pkg/core/util.py") == b"y = 2\n" and second.read("pkg/core/util.py") is None
        assert first.read("README.md") == b"# upstream\n" and second.read("README.md") == b"# upstream v2\n"
        before = len(asked)
        assert objects.tree("HEAD").read("pkg/core/mod.py") == b"x = 1\n"  # all cached but HEAD's name
        assert len(asked) == before + 1
    # 2 commits, 2 root trees, pkg and pkg/core of each (util.py was removed: new trees),
    # mod.py once, util.py once, two READMEs, and HEAD's name again.
    assert len(asked) == 2 + 2 + 4 + 1 + 1 + 2 + 1


def test_blob_reader_bad_commit_and_paths(repo: Path) -> None:
    with pytest.raises(GitError, match="not found"):
        BlobReader(repo, "no-such-commit")
    with BlobReader(repo, "HEAD") as tree:
        with pytest.raises(ValueError):
            tree.read("../outside")
        with pytest.raises(ValueError):
            tree.read("a\nb")


# -- progress --------------------------------------------------------------------------
def _bars(lines: list[str]) -> tuple[dict, RichProgress]:
    """Feed ``lines`` to RichProgress (GitPython's parser) and read the bars it drew."""
    bar = Progress(console=Console(file=io.StringIO()))
    progress = RichProgress(bar, "fetching x")
    handle = progress.new_message_handler()
    for line in lines:
        handle(line)
    tasks = {t.description: (t.completed, t.total, t.fields["detail"]) for t in bar.tasks}
    return tasks, progress


def test_progress_lines_become_one_bar_per_phase() -> None:
    tasks, progress = _bars([
        "remote: Counting objects: 100% (5/5), done.",
        "Receiving objects:  45% (4500/10000), 12.34 MiB | 5.67 MiB/s",
        "Receiving objects: 100% (10000/10000), 20.1 MiB | 5.70 MiB/s, done.",
        "Resolving deltas:  50% (3/6)",
    ])
    assert tasks == {
        "fetching x: counting objects": (5, 5, ""),
        "fetching x: receiving objects": (10000, 10000, "20.1 MiB | 5.70 MiB/s"),
        "fetching x: resolving deltas": (3, 6, ""),
    }
    assert progress.messages() == ""


def test_progress_keeps_what_is_not_progress_for_the_error_message() -> None:
    tasks, progress = _bars(["From /tmp/up", "fatal: couldn't find remote ref refs/heads/x"])
    assert tasks == {}
    assert progress.messages() == "From /tmp/up\nfatal: couldn't find remote ref refs/heads/x"


def test_run_git_with_progress(repo: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest.git"
    subprocess.run(["git", "init", "-q", "--bare", str(dest)], check=True)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    proc = run_git_with_progress(
        ["fetch", "--progress", f"file://{repo}", "+refs/heads/*:refs/heads/*"],
        dest,
        description="fetching repo",
        console=console,
    )
    assert proc.returncode == 0
    assert "Counting objects" not in proc.stderr  # progress lines went to the bars
    assert "fetching repo: counting objects" in out.getvalue()
    assert rev_parse(dest, "refs/heads/main") == git(repo, "rev-parse", "HEAD")
    with pytest.raises(GitError, match="couldn't find remote ref"):
        run_git_with_progress(
            ["fetch", "--progress", f"file://{repo}", "refs/heads/nope"],
            dest,
            console=Console(file=io.StringIO()),
        )


def test_branch_helper_is_deterministic(tmp_path: Path) -> None:
    # The helper itself: same calls, same shas (fixed identity and dates).
    a = make_repo(tmp_path / "a", {"x": "1\n"})
    b = make_repo(tmp_path / "b", {"x": "1\n"})
    assert a == b
    assert branch(tmp_path / "a", "dev") == a
