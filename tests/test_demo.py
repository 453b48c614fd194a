"""`make run`'s program (pagedserve.demo) end to end: it serves, shows the prefix cache, and stops
cleanly on a terminal's Ctrl-C (SIGINT to the whole foreground process group)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from stack import free_port


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pytest's runner may have it ignored; a shell would not


def test_demo_serves_and_stops_in_order_on_ctrl_c(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "demo.log"
    argv = [sys.executable, "-m", "pagedserve.demo", "--model", str(tiny_llama_dir),
            "--port", str(free_port()), "--executor-port", str(free_port()),
            "--metrics-port", str(free_port()), "--kv-cache-memory", "64MiB"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "wb") as log:
        # A process group of its own, like a shell's foreground job: the signal below reaches it all.
        demo = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_restore_sigint)
    try:
        deadline = time.monotonic() + 180
        while "Press Ctrl-C" not in log_path.read_text() and demo.poll() is None:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    out = log_path.read_text()
    cached = [int(n) for n in re.findall(r"tokens, (\d+) of them from the prefix cache", out)]
    assert len(cached) == 3 and cached[0] == 0 and cached[1] > 0, out  # the repeated prompt hits
    assert "stopped." in out
    # Only the demo got the SIGINT: the executor drained on its one SIGTERM, nothing was killed.
    assert "drained; exiting" in out, out
    assert "second termination signal" not in out, out
