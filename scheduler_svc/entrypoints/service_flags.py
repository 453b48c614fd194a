"""The scheduler service's flags: every option declared once, for ``--help`` and the environment.

Each knob's flag takes its default from the dataclass field it sets (:data:`FLAG_FIELDS`:
:class:`SchedulerConfig`, :class:`EngineConfig`, :class:`ServerLimits`, :class:`HttpLimits`,
:class:`GrpcLimits`), so a default lives in one place. Only the shape of each value is checked
here (its type and range, as argparse converts it); what the values mean together, and the
files they name, is checked by ``service_config.load_config``. The Kubernetes tests parse the
manifests' commands with this parser too.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pagedserve import wire
from pagedserve.envargs import number
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.engine.link_flags import add_link_flags
from scheduler_svc.front.grpc.limits import GrpcLimits
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.input.validation import LOGPROBS_MODES
from scheduler_svc.front.tool_calls import AUTO_PARSERS
from scheduler_svc.sched.scheduler_config import PREEMPTION_MODES, SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig, parse_speculative_config

DEFAULT_GRPC_PORT = 50051
DEFAULT_EXECUTOR_PORT = 5556
DEFAULT_METRICS_PORT = 9100
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible API (vLLM's port too)
PORT = number(int, "port", 0, low_inclusive=True, high=65535)  # 0: pick a free port / disable


def default(cls: type, name: str) -> Any:
    """The declared default of dataclass field ``cls.name`` (flags take theirs from here)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


# Flag -> the dataclass field it sets. Fields without a flag are learned at run time
# (SchedulerConfig.max_model_len and decode_steps come from each executor's handshake) or built from
# several flags (EngineConfig.executor_endpoint from --executor-host and --executor-port).
FLAG_FIELDS: dict[str, tuple[type, str]] = {
    "--block-size": (SchedulerConfig, "block_size"),
    "--max-num-seqs": (SchedulerConfig, "max_num_seqs"),
    "--max-num-batched-tokens": (SchedulerConfig, "max_num_batched_tokens"),
    "--preemption-mode": (SchedulerConfig, "preemption_mode"),
    "--watermark": (SchedulerConfig, "watermark"),
    "--disable-prefix-caching": (SchedulerConfig, "enable_prefix_caching"),
    "--speculative-config": (SchedulerConfig, "speculative"),
    "--heartbeat-interval": (EngineConfig, "heartbeat_interval_s"),
    "--max-queued-requests": (EngineConfig, "max_queued_requests"),
    "--max-migrations": (EngineConfig, "max_migrations"),
    "--async-scheduling": (EngineConfig, "async_scheduling"),
    "--batch-invariant": (EngineConfig, "batch_invariant"),
    "--enable-lora": (EngineConfig, "enable_lora"),
    "--lora-modules": (EngineConfig, "lora_modules"),
    "--max-loras": (EngineConfig, "max_loras"),
    "--max-lora-rank": (EngineConfig, "max_lora_rank"),
    "--max-cpu-loras": (EngineConfig, "max_cpu_loras"),
    "--allow-runtime-lora-updating": (EngineConfig, "allow_runtime_lora_updating"),
    "--stream-interval": (EngineConfig, "stream_interval"),
    "--step-timeout": (EngineConfig, "step_timeout_s"),
    "--max-failed-steps": (EngineConfig, "max_failed_steps"),
    "--orphan-timeout": (EngineConfig, "orphan_timeout_s"),
    "--served-model-name": (EngineConfig, "served_model_name"),
    **{"--" + f.name.replace("_", "-"): (ServerLimits, f.name) for f in dataclasses.fields(ServerLimits)},
    **{"--http-" + f.name.replace("_", "-"): (HttpLimits, f.name) for f in dataclasses.fields(HttpLimits)},
    **{"--grpc-" + f.name.replace("_", "-"): (GrpcLimits, f.name) for f in dataclasses.fields(GrpcLimits)},
}
RUNTIME_FIELDS = {(SchedulerConfig, "max_model_len"), (SchedulerConfig, "decode_steps"),
                  (SchedulerConfig, "lora_slots"), (EngineConfig, "scheduler"),
                  (EngineConfig, "executor_endpoint"), (EngineConfig, "model_fingerprint"),
                  (EngineConfig, "executor_link")}

_LIMIT_HELP = {
    "max_n": "largest n (parallel samples) a request may ask for",
    "max_beam_width": "largest beam_width a request may ask for",
    "max_stop_strings": "most stop strings per request (0: none allowed)",
    "max_stop_string_len": "longest stop string, in characters",
    "max_stop_token_ids": "most stop token ids per request (0: none allowed)",
    "max_logprobs": "largest number of top logprobs a request may ask for",
    "default_max_tokens": "max_tokens of a request that leaves it unset (capped by the context left)",
    "max_logit_bias": "most logit_bias entries per request (0: logit_bias is not accepted)",
    "max_structured_chars": "longest structured-output spec (JSON schema, regex, grammar, choices as JSON), in "
                            "characters (0: structured outputs are not accepted)",
    "max_request_id_len": "longest request_id, in characters",
    "max_body_bytes": "HTTP: largest request body; bigger ones get 413 before they are read (0: room for a "
                      "prompt of max_model_len tokens at 16 bytes each plus 1 MiB, e.g. 3 MiB at 131,072 tokens)",
    "max_connections": "HTTP: connections a front serves requests on; past it a request gets 503 (health probes "
                       "are still served) (0: the open-files limit, raised to the hard limit at start, less 128)",
    "max_messages": "HTTP: most messages in one chat request",
    "max_prompts": "HTTP: most prompts in one completions request (a batch)",
    "max_tools": "HTTP: most tools in one chat request",
    "body_timeout_s": "HTTP: seconds a client may take to send a request body (408 after)",
    "head_timeout_s": "HTTP: seconds a client may take to send a request line and headers, counted from "
                      "their first byte or, for a new connection, from connecting (408 and closed after)",
    "keep_alive_timeout_s": "HTTP: seconds a connection may wait for its next request after a response; "
                            "bytes that do not begin a request do not extend it (closed after)",
    "tls_handshake_timeout_s": "HTTP: seconds a new connection may take to finish its TLS handshake",
    "max_concurrent_calls": "calls in progress on both fronts together (health checks excepted); more get "
                            "429 / RESOURCE_EXHAUSTED before their request is read. 0: one per MiB of the memory "
                            "the process may use and at most 1024 per CPU (cgroup limits, else the machine's), "
                            "256..16384",
    "max_in_flight_bytes": "request bytes (HTTP bodies, gRPC messages) of the calls in progress, both fronts "
                           "together; a call that does not fit gets 429 / RESOURCE_EXHAUSTED before its body is "
                           "read. 0: an eighth of the memory the process may use, 64 MiB..1 GiB",
    "auth_failure_burst": "failed API-key attempts a peer (IP address, IPv6 /64) may make at once; beyond, its "
                          "calls get 429 / RESOURCE_EXHAUSTED without their key being checked",
    "auth_failure_refill_s": "seconds in which a peer regains one failed API-key attempt",
}
_GRPC_HELP = {
    "handshake_timeout_s": "gRPC: seconds a new connection may take for its TLS handshake and HTTP/2 preface",
    "idle_timeout_s": "gRPC: seconds a connection without calls is kept (GOAWAY and closed after; pings and "
                      "other frames do not extend it)",
    "message_timeout_s": "gRPC: seconds a call's request message may take to arrive, from the call's start "
                         "(DEADLINE_EXCEEDED after)",
    "keepalive_s": "gRPC: seconds after which the server pings a connection; one unanswered for a third of "
                   "that is closed (its calls fail)",
    "max_connection_age_s": "gRPC: seconds after which a connection gets GOAWAY, so clients reconnect and "
                            "spread over replicas; its calls in progress run to their end",
    "max_connections": "gRPC: connections a front accepts; past it a new connection is closed at once (its calls "
                       "fail UNAVAILABLE) (0: the open-files limit, raised to the hard limit at start, less 128)",
}


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve-scheduler",
        description="pagedserve scheduler: the gRPC API and the OpenAI-compatible HTTP API, request "
                    "queues, KV block tables and preemption; executors dial in over ZeroMQ. Every flag also reads "
                    "PAGEDSERVE_<FLAG> from the environment.")
    p.add_argument("--model", required=True, type=Path,
                   help="model directory (config.json and tokenizer.json are read; no weights) or GGUF file "
                        "(its metadata is read: tokenizer, chat template, eos ids)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API: what requests' model field names, /v1/models lists and "
                        "responses carry (default: --model's directory or GGUF file name, as executors report it)")
    p.add_argument("--host", default="0.0.0.0", help="gRPC listen address")
    p.add_argument("--port", type=PORT, default=DEFAULT_GRPC_PORT, help="gRPC port")
    p.add_argument("--executor-host", default=None,
                   help="address executors dial in to (default 0.0.0.0 when the link has keys, "
                        "--curve-secret-key-file or --cluster-secret-file, else 127.0.0.1: an unencrypted "
                        "executor link is never exposed by default)")
    p.add_argument("--executor-port", type=PORT, default=DEFAULT_EXECUTOR_PORT,
                   help="ZeroMQ ROUTER port executors dial in to")
    add_link_flags(p)
    p.add_argument("--allow-insecure-executors", action="store_true",
                   help="let executors dial in over a non-loopback address without keys: anyone "
                        "who reaches the port then receives prompts and can forge outputs")
    p.add_argument("--step-timeout", type=number(float, "--step-timeout", 0), default=default(EngineConfig,
                   "step_timeout_s"), dest="step_timeout_s",
                   help="seconds a step may take at least before its executor counts as failed and its requests "
                        "move (the bound grows with the executor's observed step times)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file with one API key per line: calls must send 'authorization: Bearer <key>' "
                        "(gRPC health stays open for probes)")
    p.add_argument("--tls-cert-file", type=Path, default=None, help="PEM certificate (chain) the API serves")
    p.add_argument("--tls-key-file", type=Path, default=None, help="PEM private key of --tls-cert-file")
    p.add_argument("--tls-client-ca-file", type=Path, default=None,
                   help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="Prometheus /metrics listen address")
    p.add_argument("--metrics-port", type=PORT, default=DEFAULT_METRICS_PORT,
                   help="Prometheus /metrics HTTP port (0 disables)")
    p.add_argument("--http-host", default="0.0.0.0", help="OpenAI-compatible HTTP API listen address")
    p.add_argument("--http-port", type=PORT, default=DEFAULT_HTTP_PORT,
                   help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions; 0 disables)")
    s, e = SchedulerConfig, EngineConfig
    p.add_argument("--block-size", type=int, choices=wire.BLOCK_SIZES, default=default(s, "block_size"),
                   help="tokens per KV block (executors must agree)")
    p.add_argument("--max-num-seqs", type=number(int, "--max-num-seqs", 0), default=default(s, "max_num_seqs"),
                   help="sequences per iteration per executor")
    p.add_argument("--max-num-batched-tokens", type=number(int, "--max-num-batched-tokens", 0),
                   default=default(s, "max_num_batched_tokens"),
                   help="tokens per iteration per executor (chunked prefill budget)")
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=default(s, "preemption_mode"),
                   help="what to do with a preempted request's KV blocks")
    p.add_argument("--watermark", type=number(float, "--watermark", 0.0, low_inclusive=True, high=0.5),
                   default=default(s, "watermark"),
                   help="fraction of an executor's blocks kept free when admitting requests (avoids thrashing)")
    p.add_argument("--disable-prefix-caching", action="store_false", dest="enable_prefix_caching",
                   help="do not reuse KV blocks across requests with a common prefix")
    p.add_argument("--speculative-config", type=_speculative, default=default(s, "speculative"), dest="speculative",
                   help="speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, or a draft model: {\"model\": DIR, "
                        "\"num_speculative_tokens\": 4} (every executor started with --speculative-model DIR; k in "
                        "1..16). Greedy outputs are the same with it on and off")
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=default(e, "enable_lora"),
                   help="serve LoRA adapters on the base model (--lora-modules); a request names one in its "
                        "`model` field")
    p.add_argument("--lora-modules", nargs="+", action=_ExtendTuple, default=default(e, "lora_modules"),
                   metavar="NAME=PATH",
                   help="LoRA adapters to serve, each a PEFT directory (adapter_config.json, "
                        "adapter_model.safetensors) that every executor can read at PATH; name=path or vLLM's JSON "
                        "form {\"name\": ..., \"path\": ..., \"base_model_name\": ...}. Checked at start")
    p.add_argument("--max-loras", type=number(int, "--max-loras", 0), default=default(e, "max_loras"),
                   help="LoRA adapters one step computes on an executor (at most the executor's own --max-loras "
                        "slots); requests for others wait, in arrival order")
    p.add_argument("--max-lora-rank", type=number(int, "--max-lora-rank", 0), default=default(e, "max_lora_rank"),
                   help="the highest LoRA rank an adapter may have (at most 256)")
    p.add_argument("--max-cpu-loras", type=number(int, "--max-cpu-loras", 0), default=default(e, "max_cpu_loras"),
                   help="vLLM's LoRA adapters kept in host memory: at least --max-loras. Checked here; each "
                        "executor's own --max-cpu-loras sizes its cache")
    p.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                   default=default(e, "allow_runtime_lora_updating"),
                   help="with --enable-lora: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind "
                        "the API keys), as vLLM does with VLLM_ALLOW_RUNTIME_LORA_UPDATING, which this reads too")
    p.add_argument("--max-queued-requests", type=number(int, "--max-queued-requests", 0),
                   default=default(e, "max_queued_requests"),
                   help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--api-server-count", type=number(int, "--api-server-count", 1, True), default=1,
                   help="front processes to start: each serves the gRPC and HTTP ports (shared, SO_REUSEPORT) "
                        "and does the per-request and per-token work (validation, tokenization, detokenization, "
                        "streaming), so that the scheduling loop does none of it")
    p.add_argument("--engine-cores", type=number(int, "--engine-cores", 1, True), default=1,
                   help="scheduling processes: when one process's CPU is the limit (many executors, short steps), "
                        "run several; each schedules the executors the directory (--executor-port) sends it, on "
                        "--executor-port + k, and the fronts spread requests over them")
    p.add_argument("--front-link-host", default=None,
                   help="address fronts of their own (pagedserve-front) dial in to (default 0.0.0.0 when the "
                        "link has keys, else 127.0.0.1)")
    p.add_argument("--front-link-port", type=PORT, default=0,
                   help="port for fronts of their own (pagedserve-front --core tcp://HOST:PORT); 0: off, only the "
                        "scheduler's own fronts serve (with --curve-secret-key-file the link is CURVE, and a front's "
                        "key must be in --trusted-front-keys)")
    p.add_argument("--trusted-front-keys", type=Path, default=None,
                   help="public keys of the fronts of their own that may dial the front link: a directory of "
                        "NAME.key files (`pagedserve keys front` makes a key pair) or a file of "
                        "lines 'KEY [name]'; re-read when it changes")
    p.add_argument("--shutdown-grace-seconds", type=number(float, "--shutdown-grace-seconds", 0, True),
                   default=30.0,
                   help="on SIGTERM, time in-flight requests get to finish before they are aborted")
    p.add_argument("--heartbeat-interval", type=number(float, "--heartbeat-interval", 0),
                   default=default(e, "heartbeat_interval_s"), dest="heartbeat_interval_s",
                   help="seconds between heartbeats; a peer silent for 5 intervals is dead")
    p.add_argument("--max-migrations", type=number(int, "--max-migrations", 0, True),
                   default=default(e, "max_migrations"),
                   help="times a request may move to another executor after a failure")
    p.add_argument("--max-failed-steps", type=number(int, "--max-failed-steps", 1, True),
                   default=default(e, "max_failed_steps"),
                   help="consecutive steps an executor fails as a whole (every sequence of the step) before "
                        "it is dropped and its requests move elsewhere")
    p.add_argument("--orphan-timeout", type=number(float, "--orphan-timeout", 0), dest="orphan_timeout_s",
                   default=default(e, "orphan_timeout_s"),
                   help="seconds a request whose executors all died waits for another to register before it "
                        "fails with UNAVAILABLE")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=default(e, "async_scheduling"),
                   help="plan each executor's next step while it runs the current one, so it never waits "
                        "for the scheduler (--no-async-scheduling: plan, wait, update, stream, repeat)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=default(e, "batch_invariant"),
                   help="promise every request the same log-probs whatever else shares its steps: executors "
                        "whose results depend on their batch (torch attention, CUDA) are refused, and so is one "
                        "that computes other bits than those accepted (weight format, instruction set, "
                        "tensor-parallel size). VLLM_BATCH_INVARIANT=1 turns it on too. CPU executors on "
                        "their C kernels are batch-invariant without it")
    for f in dataclasses.fields(ServerLimits):
        flag = "--" + f.name.replace("_", "-")
        zero = f.name in ServerLimits.ZERO_ALLOWED or f.name in ServerLimits.MACHINE_SIZED
        p.add_argument(flag, type=number(int, flag, 0, low_inclusive=zero, high=ServerLimits.WIRE_MAX.get(f.name)),
                       default=f.default, help=_LIMIT_HELP[f.name])
    for f in dataclasses.fields(HttpLimits):
        flag = "--http-" + f.name.replace("_", "-")
        p.add_argument(flag, type=number(int, flag, 0), default=f.default, dest=f"http_{f.name}",
                       help=_LIMIT_HELP[f.name])
    for f in dataclasses.fields(GrpcLimits):
        flag = "--grpc-" + f.name.replace("_", "-")
        p.add_argument(flag, type=number(int, flag, 0), default=f.default, dest=f"grpc_{f.name}",
                       help=_GRPC_HELP[f.name])
    p.add_argument("--stream-interval", type=number(int, "--stream-interval", 1, True),
                   default=default(e, "stream_interval"),
                   help="after a request's first streamed message, hold its tokens until one choice has this "
                        "many (or it finishes), then hand them to its stream as one message, on both fronts: "
                        "fewer wake-ups and writes (a gRPC message costs the scheduler ~20 us of CPU) for "
                        "coarser streaming; 1 = every step's tokens at once")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=LOGPROBS_MODES[0],
                   help="what reported log-probs describe: the model's raw log-softmax, or the distribution a token "
                        "is drawn from (after penalties, logit bias, a grammar, temperature and truncation); set "
                        "here, for every executor, so a request's log-probs mean the same wherever it runs")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (the default when a chat request has tools): the model's "
                        "text is parsed for tool calls with --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=tuple(AUTO_PARSERS), default=None,
                   help="how the model writes tool calls: hermes (Hermes, Qwen2.5), llama3_json (Llama 3.1-3.3), "
                        "mistral (Mistral v0.3, Nemo)")
    p.add_argument("--allowed-origins", nargs="+", action=_ExtendTuple, default=(), metavar="ORIGIN",
                   help="web origins whose pages may call the HTTP API from a browser (CORS), e.g. "
                        "https://chat.example.com, or * for any; none by default (vLLM's default is *: any web "
                        "page could then drive a server it can reach, one on localhost included)")
    p.add_argument("--allowed-methods", nargs="+", action=_ExtendTuple, default=(), metavar="METHOD",
                   help="with --allowed-origins: the methods allowed (default: all)")
    p.add_argument("--allowed-headers", nargs="+", action=_ExtendTuple, default=(), metavar="HEADER",
                   help="with --allowed-origins: the request headers allowed (default: all)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="with --allowed-origins: browsers may send cookies and credentials")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config: {exc}") from None


class _ExtendTuple(argparse.Action):
    """nargs="+" collected into a tuple, given once or more (argparse's "extend" needs a list default)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest) or ()), *values))
