"""The package as a user installs it: a wheel built from a clean copy of the tree, in fresh venvs.

One venv gets ``pagedserve[scheduler]`` (and must not contain torch or transformers), another
``pagedserve[executor]`` (CPU torch first, as the Makefile does on machines without a GPU). The
scheduler and an executor then serve the tiny model from their own venvs, and the bare
package's ``pagedserve`` CLI (from the scheduler's venv) generates through them, as does the
scheduler's OpenAI-compatible HTTP API (whose dependencies the scheduler extra must bring).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from testing.stack import free_port

ROOT = Path(__file__).resolve().parents[2]  # (tests/deploy/)
pytestmark = pytest.mark.slow
CPU_TORCH = "torch==2.13.0"  # the CPU build these machines keep on disk (see Makefile)
# No byte-compiling at install: what the services import compiles when imported, and compiling all
# of torch and transformers was most of this test's time (torch alone: 29 s against 8 s).
INSTALL = ("install", "-q", "--no-compile")


def _run(*cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_copy(dest: Path) -> Path:
    """Tracked and untracked-but-not-ignored files: what a clone of this commit would hold."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", path)
    return path / "bin"


def test_wheel_installs_per_service_and_serves(tmp_path, tiny_llama_dir):
    src = _clean_copy(tmp_path / "src")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src)
    wheel = next((tmp_path / "dist").glob("pagedserve-*.whl"))

    sched_bin = _venv(tmp_path / "venv-scheduler")
    _run(sched_bin / "pip", *INSTALL, f"{wheel}[scheduler]")
    probe = "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])"
    assert _run(sched_bin / "python", "-c", probe).stdout.strip() == "[]", "the scheduler extra pulled torch"
    wrong = subprocess.run([sched_bin / "pagedserve-executor", "--help"], capture_output=True, text=True)
    assert wrong.returncode != 0 and "pip install 'pagedserve[executor]'" in wrong.stderr

    exec_bin = _venv(tmp_path / "venv-executor")
    _run(exec_bin / "pip", *INSTALL, CPU_TORCH)
    _run(exec_bin / "pip", *INSTALL, f"{wheel}[executor]")

    port, executor_port, http_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    logs = [open(tmp_path / f"{n}.log", "wb") for n in ("scheduler", "executor")]
    procs = [
        subprocess.Popen([sched_bin / "pagedserve-scheduler", "--model", tiny_llama_dir, "--host", "127.0.0.1",
                          "--port", str(port), "--executor-host", "127.0.0.1", "--executor-port",
                          str(executor_port), "--metrics-port", "0", "--http-port", str(http_port)],
                         cwd=tmp_path, env=env, stdout=logs[0], stderr=subprocess.STDOUT),
        subprocess.Popen([exec_bin / "pagedserve-executor", "--model", tiny_llama_dir, "--scheduler",
                          f"tcp://127.0.0.1:{executor_port}", "--kv-cache-memory", "32MiB", "--health-port", "0"],
                         cwd=tmp_path, env=env, stdout=logs[1], stderr=subprocess.STDOUT),
    ]
    try:
        cli = [sched_bin / "pagedserve", "--server", f"127.0.0.1:{port}", "--timeout", "30"]
        deadline = time.monotonic() + 120
        while subprocess.run([*cli, "health"], capture_output=True, cwd=tmp_path, env=env).returncode != 0:
            assert all(p.poll() is None for p in procs), "a service exited:\n" + _logs(tmp_path)
            assert time.monotonic() < deadline, "the stack never became healthy:\n" + _logs(tmp_path)
            time.sleep(0.5)
        out = _run(*cli, "generate", "--token-ids", "1,2,3,4", "--max-tokens", "8", "--ignore-eos",
                   cwd=tmp_path, env=env)
        assert "completion_tokens=8" in out.stderr
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 8, "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 8
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("*.log"))
