"""Local ``pipeloom serve`` processes for the tests: uvicorn in a process of its own on a free port."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request

__all__ = ["SETTINGS", "serving"]

_SERVER = """
import sys

from pipeloom.serve import ServeConfig, run_server

run_server(ServeConfig(port=int(sys.argv[1]), {settings}))
"""

SETTINGS = "max_body_bytes=2**20, workers=3, request_seconds=30.0, max_actions=50_000"
"""The shared server's limits: 1 MiB bodies, 3 workers."""


@contextlib.contextmanager
def serving(settings: str):
    """The base URL and process of a local server with ``ServeConfig(port=..., <settings>)``, in a process of its
    own: its job workers' forkserver must not live in the pytest process (the spawned ranks of
    tests/runtime/test_faults.py then missed a peer's failure until its process exited)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-c", _SERVER.format(settings=settings), str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/schedules", timeout=2):
                break
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, "the server did not start"
            time.sleep(0.1)
    try:
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
