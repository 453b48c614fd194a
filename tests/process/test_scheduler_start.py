"""How the scheduler starts, or refuses to: an operator's mistake stops it at once, non-zero, naming the flag."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testing.stack import Stack, free_port, free_ports

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]  # (tests/process/)


def run_scheduler(model: Path, *flags: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """A scheduler that must exit by itself (one that serves instead fails the test on the timeout)."""
    grpc_port, executor_port = free_ports(2)
    argv = [sys.executable, "-m", "scheduler_svc", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(grpc_port), "--executor-port", str(executor_port), "--metrics-port", "0", "--http-host", "127.0.0.1",
            "--http-port", "0", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def test_a_second_scheduler_on_the_same_public_port_stops_naming_the_flag(tiny_llama_dir, tmp_path):
    """The fronts share their ports with SO_REUSEPORT; a second scheduler's fronts joined the first's
    and calls alternated between the two. Now it refuses, and the first one serves alone."""
    first = Stack(tiny_llama_dir, tmp_path)
    try:
        first.start_scheduler()  # (its fronts serve: liveness answers)
        for flag, port in (("--port", first.port), ("--http-port", first.http_port)):
            done = run_scheduler(tiny_llama_dir, flag, str(port))
            assert done.returncode == 1, done.stderr
            assert f"pagedserve-scheduler: {flag} {port}: address in use on 127.0.0.1" in done.stderr, done.stderr
            assert "scheduler ready" not in done.stderr
        assert first.scheduler.poll() is None
    finally:
        first.stop()


def test_a_public_port_another_program_holds_stops_the_scheduler(tiny_llama_dir):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # (it would share: the scheduler must not)
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        done = run_scheduler(tiny_llama_dir, "--metrics-port", str(port))
    assert done.returncode == 1
    assert f"pagedserve-scheduler: --metrics-port {port}: address in use on 0.0.0.0" in done.stderr, done.stderr


def test_a_front_that_cannot_start_stops_the_scheduler_with_its_reason(tiny_llama_dir, tmp_path):
    """A broken chat template stops every front at start, and would on every restart: the scheduler
    started them again forever ("local-0.1 exited with status 1; starting it again") after logging
    "scheduler ready". Now it stops with the front's reason, never having said ready."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").write_text("{% if %}")
    done = run_scheduler(model, "--api-server-count", "2", "--http-port", str(free_port()))  # (HTTP reads it)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve-scheduler: local-") and " could not start: --model: " in last, done.stderr
    assert "scheduler ready" not in done.stderr and "starting it again" not in done.stderr


@pytest.mark.parametrize("flag,value,message", [
    ("--executor-port", "HELD", "pagedserve-scheduler: --executor-port {held}: address in use on 127.0.0.1"),
    ("--metrics-host", "nosuchhost.invalid",
     "pagedserve-scheduler: --metrics-host nosuchhost.invalid: not an address this machine can listen on"),
])
def test_what_the_scheduler_cannot_bind_is_a_message_naming_the_flag(tiny_llama_dir, flag, value, message):
    """Tracebacks before: zmq.error.ZMQError (Address already in use), socket.gaierror."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        held = str(s.getsockname()[1])
        flags = [flag, held if value == "HELD" else value]
        if flag == "--metrics-host":
            flags += ["--metrics-port", str(free_port())]
        done = run_scheduler(tiny_llama_dir, *flags)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(message.format(held=held)), done.stderr
    assert "Traceback" not in done.stderr
