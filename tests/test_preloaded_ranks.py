"""CPU ranks forked from a preloaded server behave as fresh ranks: same output, environment, exit
codes and failures, the imports done once; and whatever the server cannot vouch for starts fresh."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from megaport.train import failure  # noqa: E402
from megaport.train.preloaded import launcher, protocol, servers  # noqa: E402
from megaport.train.torchrun import Ranks, node_commands  # noqa: E402

SCRIPT = """\
import os, sys, time
import imported_once

print("rank", os.environ.get("RANK"), "of", os.environ.get("WORLD_SIZE"), "value", imported_once.VALUE,
      "threads", __import__("torch").get_num_threads(), "cwd", os.getcwd(), "args", sys.argv[1:], flush=True)
if "--fail" in sys.argv:
    raise ValueError("planted failure")
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[-1]))
if "--sleep" in sys.argv:
    print("pid", os.getpid(), flush=True)
    time.sleep(120)
"""
MODULE = """\
import os
with open(os.environ["IMPORTS_LOG"], "a") as log:
    log.write(str(os.getpid()) + "\\n")
VALUE = VALUE_HERE
"""


@pytest.fixture
def tree(tmp_path):
    folder = tmp_path / "tree"
    folder.mkdir()
    (folder / "pretrain_fake.py").write_text(SCRIPT)
    (folder / "imported_once.py").write_text(MODULE.replace("VALUE_HERE", repr("first")))
    return folder


@pytest.fixture
def env(tree, tmp_path):
    src = str(Path(__file__).resolve().parents[1] / "src")
    environment = {k: v for k, v in os.environ.items() if not protocol.per_run(k)}
    environment.update(PYTHONPATH=os.pathsep.join([str(tree), src]), IMPORTS_LOG=str(tmp_path / "imports.log"))
    yield environment
    servers.stop_all()


def _imports(env) -> list:
    path = Path(env["IMPORTS_LOG"])
    return path.read_text().split() if path.exists() else []


def _torchrun(tree, env, *args, ranks=2, timeout=120, forked=False):
    command = node_commands(Ranks(ranks), ["-m", "megaport.train.launch", "--cpu", "pretrain_fake.py", *args])[0]
    command = launcher.forked_argv(command) if forked else command
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)


def _served(tree, env) -> dict:
    return {**env, **servers.environment_for(str(tree / "pretrain_fake.py"), env)}


def test_ranks_fork_from_one_import_and_see_their_own_rank(tree, env):
    served = _served(tree, env)
    assert served[protocol.ENV], "no server started"
    for _ in range(2):
        proc = _torchrun(tree, served, "--flag", "x")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for rank in ("0", "1"):
            assert f"rank {rank} of 2 value first threads 1 cwd {tree} args ['--flag', 'x']" in proc.stdout
        assert proc.stdout.count(f"{protocol.MARK} rank: forked from the preloaded imports of pretrain_fake.py") == 2
    assert len(_imports(env)) == 1, "two runs of two ranks imported more than once: the ranks did not fork"


def test_torchrun_itself_forks_and_its_exit_says_whether_a_rank_failed(tree, env):
    served = _served(tree, env)
    proc = _torchrun(tree, served, forked=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{protocol.MARK} torchrun: forked from the preloaded imports" in proc.stdout
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout
    failed = _torchrun(tree, served, "--fail", forked=True)
    assert failed.returncode != 0 and "ValueError: planted failure" in failed.stderr
    assert len(_imports(env)) == 1


def test_without_a_server_torchrun_and_its_ranks_start_fresh(tree, env):
    proc = _torchrun(tree, {**env, protocol.ENV: "0"}, forked=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_imports(env)) == 2 and protocol.MARK not in proc.stdout


def test_without_a_server_every_rank_imports(tree, env):
    proc = _torchrun(tree, {**env, protocol.ENV: "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_imports(env)) == 2 and protocol.MARK not in proc.stdout


def test_a_failing_rank_prints_its_traceback_records_its_failure_and_fails_the_run(tree, env, tmp_path):
    failures = tmp_path / "failures"
    failures.mkdir()
    proc = _torchrun(tree, {**_served(tree, env), failure.FAILURE_DIR_ENV: str(failures)}, "--fail")
    assert proc.returncode != 0
    assert "ValueError: planted failure" in proc.stderr and "forked from the preloaded" in proc.stdout
    recorded = failure.read(failures)
    assert [f.exception for f in recorded] == ["ValueError", "ValueError"], recorded


def _rank_env(env, rank="0"):
    return {**env, "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def test_the_rank_exits_with_the_scripts_code(tree, env):
    proc = subprocess.run([sys.executable, "-m", "megaport.train.launch", "--cpu", "pretrain_fake.py", "--exit", "3"],
                          cwd=tree, env=_rank_env(_served(tree, env)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "forked from the preloaded" in proc.stdout


def _sleeping_rank(tree, env):
    proc = subprocess.Popen([sys.executable, "-m", "megaport.train.launch", "--cpu", "pretrain_fake.py", "--sleep"],
                            cwd=tree, env=_rank_env(_served(tree, env)), stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("pid "):
            return proc, int(line.split()[1])
    raise AssertionError(f"the rank printed no pid (exit {proc.wait()})")


def _gone(pid, within=10.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_the_rank_reaches_the_forked_child_and_its_exit_says_so(tree, env):
    proc, child = _sleeping_rank(tree, env)
    assert child != proc.pid, "the script ran in the rank's own process, not a fork"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert _gone(child)


def test_a_killed_rank_takes_its_forked_child_with_it(tree, env):
    proc, child = _sleeping_rank(tree, env)
    proc.kill()
    proc.wait(timeout=30)
    assert _gone(child), "the forked rank outlived the process torchrun killed"


def test_a_tree_file_changed_since_the_imports_starts_the_rank_fresh_and_a_new_server_next(tree, env):
    assert _torchrun(tree, _served(tree, env), ranks=1).returncode == 0
    module = tree / "imported_once.py"
    module.write_text(MODULE.replace("VALUE_HERE", repr("second, planted after the imports")))
    stale = _torchrun(tree, {**env, **servers.environment_for(str(tree / "pretrain_fake.py"), env)}, ranks=1)
    assert stale.returncode == 0, stale.stdout + stale.stderr
    assert "changed since its imports" in stale.stdout and "value second, planted" in stale.stdout
    fresh_server = _torchrun(tree, _served(tree, env), ranks=1)
    assert "value second, planted" in fresh_server.stdout and "forked from the preloaded" in fresh_server.stdout


def test_a_rank_in_another_environment_starts_fresh(tree, env):
    served = _served(tree, env)
    proc = _torchrun(tree, {**served, "SOME_SETTING": "read at import, perhaps"}, ranks=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank: fresh interpreter (the preloaded server refused: its environment differs in SOME_SETTING" in proc.stdout
    assert len(_imports(env)) == 2  # the server's and the fresh rank's


def test_imports_that_fail_are_left_to_the_rank_to_meet(tree, env):
    (tree / "imported_once.py").write_text("raise ImportError('planted at import')\n")
    proc = _torchrun(tree, _served(tree, env), ranks=1)
    assert proc.returncode != 0
    assert "refused: its imports failed (ImportError: planted at import)" in proc.stdout
    assert "ImportError: planted at import" in proc.stderr


def test_the_server_ends_with_the_process_that_started_it(tree, env):
    code = ("import json, os, sys; from megaport.train.preloaded import servers; "
            f"print(json.dumps(servers.environment_for({str(tree / 'pretrain_fake.py')!r}, dict(os.environ))), "
            "flush=True); os._exit(0)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    socket_path = __import__("json").loads(proc.stdout.splitlines()[-1])[protocol.ENV]
    end = time.monotonic() + 15
    while os.path.exists(socket_path) and time.monotonic() < end:
        time.sleep(0.1)
    assert not os.path.exists(os.path.dirname(socket_path)), "the server outlived its owner"
