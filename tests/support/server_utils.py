"""The built-in rollout server as a real subprocess (``python -m archon.server.app``), for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dist_utils import find_free_port

REPO = Path(__file__).resolve().parents[2]
_PORT_TRIES = 3


@dataclass
class ServerProcess:
    """A launched server: its process, address and command-line options."""

    proc: subprocess.Popen
    url: str
    folder: Path
    extra: tuple[str, ...]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def launch_server(folder: Path, *extra: str) -> ServerProcess:
    """Start a server for ``folder`` on a free port (not yet healthy: see ``wait_healthy``)."""
    port = find_free_port()
    cmd = [sys.executable, "-m", "archon.server.app", "--model-path", str(folder), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--random-seed", "0", "--log-level", "warning", "--dtype", "float32", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("ARCHON_API_KEY", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", Path(folder), extra)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(server: ServerProcess, timeout: float = 300.0) -> ServerProcess:
    """``server`` once it answers /health; one whose port was taken between picking and binding is
    started again on another port (the returned one)."""
    deadline = time.monotonic() + timeout
    for _ in range(_PORT_TRIES):
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                break
            if _healthy(server.url):
                return server
            time.sleep(0.1)
        else:
            server.stop()
            raise AssertionError(f"the server for {server.folder} did not become healthy within {timeout:g} s")
        assert server.proc.stdout is not None
        log = server.proc.stdout.read()
        if "address already in use" not in log.lower():
            raise AssertionError(f"the server exited with {server.proc.returncode}:\n{log}")
        server = launch_server(server.folder, *server.extra)
    raise AssertionError(f"the server for {server.folder} found its port taken {_PORT_TRIES} times")


def start_server(folder: Path, *extra: str, timeout: float = 300.0) -> ServerProcess:
    """A healthy server for ``folder``."""
    return wait_healthy(launch_server(folder, *extra), timeout)
