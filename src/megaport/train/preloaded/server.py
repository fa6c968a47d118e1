"""The preloaded process: imports torch and what the entry point imports, once, then forks a child
for each rank that asks, and for torchrun itself (see the package's docstring for why).

    python -m megaport.train.preloaded.server SOCKET SCRIPT --owner PID

It starts in the rank's environment and folder (the verifying process starts it, :mod:`.servers`),
binds SOCKET before its imports (ranks wait in the queue), ends when its owner does or on SIGTERM
(once its children have ended), and takes SOCKET's folder with it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import traceback
import warnings

from megaport.train.preloaded import protocol

#: how often the loop looks for ended children and a gone owner (seconds): a rank's exit code
#: reaches torchrun at most this late
_TICK = 0.05


@dataclasses.dataclass
class Preloaded:
    """What the imports left: the lines and output a fresh rank prints before its script runs, and
    what a request must match to be served."""

    script: str
    environment: dict
    lines: list = dataclasses.field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    files: dict = dataclasses.field(default_factory=dict)
    threads: int = 1
    refused: str = ""
    torch: object = None

    def refusal(self, request: dict) -> str:
        """Why this server cannot run ``request`` as a fresh rank would ("" where it can)."""
        if self.refused:
            return self.refused
        if request["kind"] not in ("rank", "launcher"):
            return f"it runs ranks and torchrun, not {request['kind']!r}"
        if request["kind"] == "rank" and request["script"] != self.script:
            return f"it imported for {self.script}, not {request['script']}"
        wanted = protocol.imports_environment(request["env"])
        differing = sorted(k for k in set(wanted) | set(self.environment) if wanted.get(k) != self.environment.get(k))
        if differing:
            return f"its environment differs in {', '.join(differing[:5])}"
        return ""

    def stale(self) -> str:
        """Why the imports no longer hold: the first imported file changed since (a test that plants
        a fault in the tree between two runs), or ""."""
        return changed_file(self.files)


def changed_file(files: dict) -> str:
    """The first of ``files`` (path -> (mtime_ns, size)) changed since, said in a few words; or ""."""
    for path, seen in files.items():
        try:
            now = os.stat(path)
        except OSError:
            return f"{path} is gone since its imports"
        if (now.st_mtime_ns, now.st_size) != seen:
            return f"{path} changed since its imports"
    return ""


def imported_files() -> dict:
    return {path: (s.st_mtime_ns, s.st_size) for path, s in
            ((m.__file__, _stat(m.__file__)) for m in list(sys.modules.values())
             if isinstance(getattr(m, "__file__", None), str)) if s is not None}


def _stat(path):
    try:
        return os.stat(path)
    except OSError:
        return None


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def import_like(script: str) -> None:
    """Run the script's top-level import statements, in its order (not its other code): what the
    script will find already imported."""
    with open(script, encoding="utf-8") as handle:
        body = ast.parse(handle.read(), script).body
    imports = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))
               and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    code = compile(ast.Module(body=imports, type_ignores=[]), script, "exec")
    exec(code, {"__name__": "__megaport_preload__", "__file__": script})  # noqa: S102 - the tree's own imports


def preload(script: str) -> Preloaded:
    """Import as a fresh ``--cpu`` rank of ``script`` would before the script's own code: torch, the
    CPU substitutions (:func:`megaport.train.launch.prepare`), then the script's imports; their
    output is kept for each child to print."""
    state = Preloaded(script, protocol.imports_environment(os.environ))
    captured = [tempfile.TemporaryFile(mode="w+b") for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(captured[0].fileno(), 1)
    os.dup2(captured[1].fileno(), 2)
    try:
        import torch

        from megaport.train import launch

        state.torch, state.threads = torch, os_threads()
        state.lines = launch.prepare(torch, os.path.dirname(script), cpu=True)
        sys.path.insert(0, os.path.dirname(script))
        sys.argv = [script]  # what an import that reads it sees in a rank (the run's flags come later)
        import_like(script)
    except BaseException as exc:  # noqa: BLE001 - the rank will meet it itself, in a fresh interpreter
        state.refused = f"its imports failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    state.stdout, state.stderr = (_read(f) for f in captured)
    if not state.refused and os_threads() > state.threads:
        state.refused = (f"its imports started threads ({os_threads()} where torch's import leaves {state.threads}): "
                         "a fork would copy their locks, not them")
    state.files = imported_files()
    return state


def _read(handle) -> str:
    handle.seek(0)
    return handle.read().decode(errors="replace")


class Server:
    """The loop: accept, fork, report exit codes; single-threaded, so a fork copies no other thread."""

    def __init__(self, listener: socket.socket, path: str, state: Preloaded, owner: int):
        self.listener, self.path, self.state, self.owner = listener, path, state, owner
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.children: dict = {}  # pid -> the connection of the rank's own process
        self.draining = self.stop_asked = False
        self.default_threads = state.torch.get_num_threads() if state.torch is not None else 1

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self.ask_to_stop)
        while not (self.draining and not self.children):
            if self.stop_asked:
                self.drain()
            for key, _ in self.selector.select(_TICK):
                if key.fileobj is self.listener and not self.draining:
                    self.accept()
                elif key.fileobj is not self.listener:
                    self.hung_up(key.fileobj)
            self.reap()
            if os.getppid() != self.owner:
                for pid in self.children:
                    _kill(pid)
                self.drain()

    def ask_to_stop(self, signum, frame) -> None:
        """SIGTERM (the owner's stop): drained at the loop's next turn, never in the middle of one."""
        self.stop_asked = True

    def drain(self) -> None:
        """Take no more ranks (the socket goes at once, so the owner starts another server); end
        once the children have."""
        if not self.draining:
            self.draining = True
            self.selector.unregister(self.listener)
            self.listener.close()
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list = []
        try:
            conn.settimeout(30)
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            request = protocol.receive(conn)
            stale = self.state.stale()
            why = "no request" if request is None else self.state.refusal(request) or stale
            if why:
                protocol.send(conn, {"refused": why})
                conn.close()
                if stale:
                    self.drain()  # the owner starts a server on today's files for the next run
                return
            conn.settimeout(None)
            pid = os.fork()
            if pid == 0:
                self.child(conn, fds, request)  # never returns
            protocol.send(conn, {"pid": pid})
            self.children[pid] = conn
            self.selector.register(conn, selectors.EVENT_READ)
        except (OSError, ValueError, KeyError, TypeError):  # a rank gone mid-request, or not a request
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def hung_up(self, conn) -> None:
        """The rank's own process went (torchrun killed it): so does the child. (A process killed
        before it read the child's pid resets the connection instead of closing it.)"""
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        self.selector.unregister(conn)
        for pid, held in list(self.children.items()):
            if held is conn:
                _kill(pid)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            try:
                protocol.send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            if conn.fileno() >= 0:
                try:
                    self.selector.unregister(conn)
                except (KeyError, ValueError):
                    pass
                conn.close()

    def child(self, conn, fds: list, request: dict) -> None:
        """The rank (or torchrun): the request's streams, folder and per-run environment, then
        :meth:`rank` or :meth:`launcher`; never returns."""
        code = 1
        try:
            self.selector.close()
            self.listener.close()
            for held in [conn, *self.children.values()]:
                held.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            for name in [k for k in os.environ if protocol.per_run(k)]:
                del os.environ[name]
            os.environ.update({k: v for k, v in request["env"].items() if protocol.per_run(k)})
            code = (self.rank if request["kind"] == "rank" else self.launcher)(request)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the process's exit
            sys.excepthook(*sys.exc_info())
            code = 1
        finally:
            from megaport.train import launch

            launch.exit_without_teardown(code)

    def rank(self, request: dict) -> int:
        """The fresh rank's thread count and output so far, then the script as
        :mod:`megaport.train.launch` runs it."""
        torch = self.state.torch
        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else self.default_threads)
        print(f"{protocol.MARK} rank: forked from the preloaded imports of {os.path.basename(self.state.script)} "
              f"(server {os.getppid()})", flush=True)
        for line in self.state.lines:
            print(line, flush=True)
        sys.stdout.write(self.state.stdout)
        sys.stderr.write(self.state.stderr)
        from megaport.train import launch

        return launch.run_script(torch, request["script"], request["arguments"], cpu=True)

    def launcher(self, request: dict) -> int:
        """torchrun's own main with the request's arguments (its ranks then ask this server too)."""
        from torch.distributed import run

        os.environ.clear()  # torchrun hands its environment to the ranks: the run's, not what the imports set
        os.environ.update(request["env"])
        print(f"{protocol.MARK} torchrun: forked from the preloaded imports (server {os.getppid()})", flush=True)
        sys.argv = ["torchrun", *request["arguments"]]
        try:
            run.main()
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - printed from torchrun's own frames, as torchrun prints it
            traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
            return 1
        return 0


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("socket")
    parser.add_argument("script")
    parser.add_argument("--owner", type=int, required=True, help="the verifying process: the server ends with it")
    args = parser.parse_args(argv)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.socket)
    listener.listen(64)
    # torch's import starts one thread of its own (every torch process has it; DataLoader workers
    # fork the same way); preload() refuses to serve where the imports started any other
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
    state = preload(os.path.abspath(args.script))
    try:
        Server(listener, args.socket, state, args.owner).serve()
    finally:
        shutil.rmtree(os.path.dirname(args.socket), ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no atexit of the imports (a baseline's audit would report into a finished run's folder)


if __name__ == "__main__":
    main()
