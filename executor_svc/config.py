"""The executor process's configuration: flags, environment, validation.

Built once in ``__main__`` and frozen. Every flag also reads
``PAGEDSERVE_<FLAG>`` from the environment (the command line wins); this is
the only place the executor reads the environment. Values learned at run time
(how many KV blocks fit) go into the handshake, never back into this object.

With ``--tensor-parallel-size N > 1`` the process is one rank of a group
(executor_svc/parallel/). Its place in the group comes from torch.distributed's
standard rendezvous variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) when they are set (multi-node, torchrun,
LeaderWorkerSet); otherwise this process leads and starts ranks 1..N-1 itself.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from executor_svc.graph_buckets import DEFAULT_SIZES as DEFAULT_GRAPH_SIZES
from executor_svc.graph_buckets import parse_sizes
from pagedserve import wire
from pagedserve.draft_model import check_draft
from pagedserve.envargs import number, parse_bytes, parse_with_env
from pagedserve.model_dir import is_gguf, resolve_model
from pagedserve.wire.enrollment import read_tokens
from pagedserve.wire.key_files import load_key_pair, load_public_key
from pagedserve.wire.keys import ClientKeys, load_cluster_keys

DTYPES = ("auto", "float32", "float16", "bfloat16")
CPU_ATTENTION = ("auto", "fused", "torch")  # --cpu-attention; executor_svc/backends.py acts on it
QUANTIZATIONS = ("int8", "gguf")  # --quantization (CPU): executor_svc/model/cpu_pack.py
MAX_CPU_THREADS = 4096
DEVICES = ("cpu", "cuda")
LEADER_PID_ENV = "PAGEDSERVE_TP_LEADER_PID"  # set by a local leader for the ranks it starts


@dataclass(frozen=True, slots=True)
class RankEnv:
    """Where this process sits in its tensor-parallel group (torch.distributed's variables)."""

    rank: int
    world_size: int
    local_rank: int  # the CUDA device index on this node
    master_addr: str  # host of rank 0, which serves the group's TCPStore
    master_port: int
    leader_pid: int | None = None  # set when a local leader started this rank (it watches that pid)


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    model_dir: Path
    scheduler: str  # ZeroMQ endpoint of the scheduler's ROUTER, e.g. tcp://host:5556
    device: str
    kv_cache_memory: int  # bytes for the device block pools on CPU
    gpu_memory_utilization: float  # fraction of GPU memory this process may use (CUDA)
    swap_space: int  # bytes for the CPU swap pool
    block_size: int
    dtype: str
    cpu_attention: str  # auto | fused | torch (executor_svc/backends.py, make_attention_backend)
    executor_id: str
    health_port: int  # 0 = no health server
    health_host: str
    drain_timeout: float  # seconds to keep serving after SIGTERM
    link_keys: ClientKeys | None  # CURVE keys of the link to the scheduler (None: unencrypted)
    log_level: str
    tensor_parallel_size: int = 1  # ranks serving one model as one executor (executor_svc/parallel)
    prepare_ahead: bool | None = None  # prepare each plan while the step before runs (None: on with CUDA)
    rank_env: RankEnv | None = None  # None with N > 1: this process leads and starts the others
    cpu_threads: int | None = None  # CPU compute threads (None: OMP_NUM_THREADS, else usable CPUs; threads.py)
    cpu_decode_threads: str = "adaptive"  # fused decode steps: "all" threads, or "adaptive" (step_threads.py)
    decode_steps: int = 8  # the most decode steps one plan may carry (1 with --prepare-ahead or N ranks)
    quantization: str | None = None  # CPU weight quantization (None: weights in --dtype; "gguf": the file's blocks)
    warmup: bool = True  # run warm-up steps before registering (executor_svc/warmup.py)
    enforce_eager: bool = False  # CUDA: no decode graphs (executor_svc/decode_graphs.py)
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES  # decode batch sizes captured as graphs
    enrollment_token_file: Path | None = None  # proves this executor may enroll its key (read at each connection)
    batch_invariant: bool = False  # refuse to start unless results are batch-invariant (batch_invariance.py)
    max_loras: int = 0  # LoRA adapter slots (--enable-lora --max-loras; 0: no adapters; executor_svc/lora)
    max_lora_rank: int = 16  # the highest adapter rank a slot holds
    speculative_model: Path | None = None  # a draft model for speculative decoding (executor_svc/speculative/draft.py)
    lora_dtype: str = "float32"  # the slots' tensors: "float32" (exact against PEFT) or "bfloat16" (half the bytes)
    max_cpu_loras: int = 0  # parsed adapters kept in host memory (LRU; executor_svc/lora/cache.py); 0: none
    fused_layers: bool = True  # CUDA: decoder layers on the fused kernels (executor_svc/model/cuda_layers.py)


def _endpoint(text: str) -> str:
    """A ZeroMQ endpoint whose form is right now: a wrong one would be dialled (and retried) forever."""
    if text.startswith("tcp://"):
        host, _, port = text[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT with a port in 1..65535, "
                                             f"got {text!r}")
    elif not text.startswith(("ipc://", "inproc://")) or text.endswith("//"):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT, got {text!r}")
    return text


def require_device(cfg: ExecutorConfig) -> None:
    """--device cuda needs a CUDA device (else torch fails deep in loading: "Torch not compiled with CUDA
    enabled"). Here, not in parse_config: the configs of GPU executors are built on CPU machines too."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else \
            "no GPU is visible (none installed, CUDA_VISIBLE_DEVICES, or the driver)"
        raise SystemExit(f"pagedserve-executor: --device cuda: CUDA is not available to this process ({why}); "
                         f"use --device cpu")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve-executor",
        description="Run a Llama-family model on a paged KV cache for a pagedserve scheduler. "
                    "Every flag also reads PAGEDSERVE_<FLAG> from the environment.")
    p.add_argument("--model", required=True, help="HF model directory (config.json, *.safetensors) or GGUF file "
                                                  "(on CPU its quantized layers stay quantized unless --dtype is "
                                                  "given; dequantized to --dtype at load on CUDA)")
    p.add_argument("--scheduler", required=True, type=_endpoint, help="scheduler endpoint, tcp://HOST:5556")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("2GiB"),
                   help="KV cache size on CPU (e.g. 2GiB)")
    p.add_argument("--gpu-memory-utilization", type=number(float, "--gpu-memory-utilization", 0.0, high=1.0),
                   default=0.9, help="fraction of GPU memory for weights + KV cache (CUDA)")
    p.add_argument("--swap-space", type=parse_bytes, default=parse_bytes("4GiB"),
                   help="CPU swap pool size (e.g. 4GiB; 0 disables swapping)")
    p.add_argument("--block-size", type=int, choices=wire.BLOCK_SIZES, default=wire.DEFAULT_BLOCK_SIZE,
                   help="tokens per KV block; must match the scheduler's")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype; auto = float32 on CPU, the checkpoint's on CUDA. On CPU it is the "
                        "weights' and the KV cache's dtype; activations stay float32")
    p.add_argument("--cpu-attention", choices=CPU_ATTENTION, default="auto",
                   help="CPU decode attention: fused = the C kernel (executor_svc/csrc), torch = gather + "
                        "SDPA and the linear layers on torch too (no C library); auto = fused when it compiles, "
                        "else torch with a warning")
    p.add_argument("--executor-id", default=None, help="name in the scheduler's registry (default HOST-PID)")
    p.add_argument("--health-port", type=number(int, "--health-port", 0, low_inclusive=True, high=65535),
                   default=8090, help="grpc.health.v1 port (0 disables)")
    p.add_argument("--health-host", default="[::]",
                   help="grpc.health.v1 listen address (the kubelet probes it; it serves status only)")
    p.add_argument("--drain-timeout", type=number(float, "--drain-timeout", 0.0, low_inclusive=True),
                   default=30.0, help="seconds to keep serving plans after SIGTERM")
    p.add_argument("--curve-key-file", type=Path, default=None,
                   help="this executor's own CURVE key pair (`pagedserve keys executor` writes NAME.key_secret): "
                        "the link is then authenticated and encrypted; needs --scheduler-public-key-file")
    p.add_argument("--scheduler-public-key-file", type=Path, default=None,
                   help="the scheduler's public key (`pagedserve keys scheduler` writes NAME.key)")
    p.add_argument("--enrollment-token-file", type=Path, default=None,
                   help="enrollment token (the file's first): join a scheduler that does not list this "
                        "executor's key by proving it holds the token, for that key; read at every connection")
    p.add_argument("--cluster-secret-file", type=Path, default=None,
                   help="one machine or development only: the secret the scheduler was given, from which both "
                        "derive the link's keys (every holder can act as the scheduler)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--cpu-threads", default=None,
                   type=number(int, "--cpu-threads", 1, low_inclusive=True, high=MAX_CPU_THREADS),
                   help="CPU compute threads; wins over OMP_NUM_THREADS (default: the CPUs this process may use, "
                        "cgroup quota included, one left free from 8 up)")
    p.add_argument("--cpu-decode-threads", choices=("adaptive", "all"), default="adaptive",
                   help="fused decode steps of up to 64 sequences: 'adaptive' times all compute threads against "
                        "one fewer now and then and keeps the faster (one fewer wins when the serving tier shares "
                        "these CPUs); 'all' always uses --cpu-threads. Outputs are the same either way")
    p.add_argument("--decode-steps", default=8,
                   type=number(int, "--decode-steps", 1, low_inclusive=True, high=wire.MAX_DECODE_STEPS),
                   help="decode steps one plan may carry, run back to back (the scheduler asks for them when "
                        "every running request decodes plainly and none waits): the plan's, the link's and this "
                        "executor's per-step cost paid once for several tokens, which then stream in bursts of "
                        "that many; for short steps (small models on CPU). 1 turns it off; with --prepare-ahead "
                        "(CUDA) or tensor parallelism it is 1")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="CPU: int8 = linear weights rounded to int8 in blocks of 32 with a scale each "
                        "(llama.cpp's Q8_0; activations quantised the same way on the fly), ~a quarter of "
                        "float32's bytes per step; gguf = a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K layers computed as "
                        "stored (the default for a GGUF file with --dtype auto; an explicit --dtype "
                        "dequantizes them at load)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a few prefill and decode steps before registering, so the first request runs "
                        "at steady-state speed")
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                   help="serve LoRA adapters: --max-loras slots, each loaded with the adapter the scheduler names "
                        "(a PEFT directory this executor can read)")
    p.add_argument("--max-loras", type=number(int, "--max-loras", 0), default=1,
                   help="with --enable-lora: adapters held at once, and computed together in one step")
    p.add_argument("--max-lora-rank", type=number(int, "--max-lora-rank", 0), default=16,
                   help="with --enable-lora: the highest adapter rank a slot holds (at most 256; slots are sized "
                        "for it)")
    p.add_argument("--speculative-model", type=Path, default=None,
                   help="a draft model for speculative decoding (a directory or GGUF file, with the model's tokenizer): "
                        "it proposes the tokens the model verifies, on KV pools of its own with the same blocks; the "
                        "scheduler's --speculative-config must name it ({\"model\": DIR, ...})")
    p.add_argument("--lora-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="with --enable-lora: what the adapter slots hold. bfloat16 halves the bytes a CPU decode "
                        "step reads (weights rounded once, sums in float32); float32 is exact against PEFT's "
                        "float32 products. auto: bfloat16 on CPU, float32 on CUDA (whose torch products would "
                        "widen bfloat16 slots at every step)")
    p.add_argument("--max-cpu-loras", type=number(int, "--max-cpu-loras", 0), default=None,
                   help="with --enable-lora: parsed, checked adapters kept in host memory (least recently used "
                        "dropped first), so a slot loads an adapter seen recently without reading its files "
                        "again; at least --max-loras (the default)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every decode step's kernels one by one instead of replaying a CUDA "
                        "graph captured at start (as vLLM's flag); prefill and mixed steps are always eager")
    p.add_argument("--cuda-graph-sizes", type=_graph_sizes, default=DEFAULT_GRAPH_SIZES,
                   help="CUDA: decode batch sizes captured as graphs, comma-separated (default 1,2,4,8 and "
                        "every multiple of 8 to 256); a step of n sequences replays the smallest size >= n, "
                        "a larger one runs eagerly")
    p.add_argument("--fused-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: run each decoder layer's norms (with the residual add), RoPE (with the KV-cache "
                        "write) and SiLU-and-mul as fused kernels, three launches where the torch ops take about "
                        "thirty; --no-fused-layers runs the torch ops (for comparison, or as a fallback)")
    p.add_argument("--prepare-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="check and apply each queued plan and build its batch while the device runs the "
                        "step before, so the device does not wait for that host work (default: on with "
                        "--device cuda; on CPU nothing overlaps). Outputs are the same either way; one "
                        "device only (tensor parallelism runs its steps in order)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                   help="refuse to start unless a token's results cannot depend on the rest of its step "
                        "(CPU executors on their C kernels always qualify; torch attention and CUDA do not). "
                        "VLLM_BATCH_INVARIANT=1 turns it on too; the scheduler's flag of that name requires it")
    p.add_argument("--tensor-parallel-size", default=1,
                   type=number(int, "--tensor-parallel-size", 1, low_inclusive=True, high=wire.MAX_TENSOR_PARALLEL_SIZE),
                   help="serve the model across N ranks as one executor (Megatron-style sharding; one "
                        "process per rank, GPUs 0..N-1 with --device cuda). Started alone, this process "
                        "starts the other ranks; with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and "
                        "LOCAL_RANK) set it joins a group started elsewhere (multi-node)")
    return p


def _env_int(environ: dict[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"{name}: required with RANK set (torch.distributed rendezvous variables)")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {text!r}") from None


def rank_env(tp_size: int, environ: dict[str, str]) -> RankEnv | None:
    """The group position from RANK/WORLD_SIZE/... (None when RANK is unset: a local leader)."""
    if tp_size == 1 or "RANK" not in environ:
        return None
    rank, world = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
    if world != tp_size:
        raise ValueError(f"--tensor-parallel-size is {tp_size} but WORLD_SIZE is {world}: one group "
                         f"of ranks is one executor, so they must be equal")
    if not 0 <= rank < world:
        raise ValueError(f"RANK: must lie in [0, WORLD_SIZE={world}), got {rank}")
    port = _env_int(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT: must lie in [1, 65535], got {port}")
    addr = environ.get("MASTER_ADDR")
    if not addr:
        raise ValueError("MASTER_ADDR: required with RANK set (the host of rank 0)")
    leader = environ.get(LEADER_PID_ENV)
    return RankEnv(rank, world, _env_int(environ, "LOCAL_RANK", 0), addr, port,
                   int(leader) if leader else None)


def _link_keys(args: argparse.Namespace) -> ClientKeys | None:
    """The link's keys from the flags (None: no CURVE); ValueError naming the flag."""
    identity = {"--curve-key-file": args.curve_key_file, "--scheduler-public-key-file": args.scheduler_public_key_file,
                "--enrollment-token-file": args.enrollment_token_file}
    given = [flag for flag, value in identity.items() if value is not None]
    if args.cluster_secret_file is not None:
        if given:
            raise ValueError(f"--cluster-secret-file: not with {', '.join(given)} (a cluster secret is the keys "
                             f"of both sides)")
        return load_cluster_keys(args.cluster_secret_file).client
    if not given:
        return None
    if args.curve_key_file is None or args.scheduler_public_key_file is None:
        raise ValueError(f"{given[0]}: needs --curve-key-file and --scheduler-public-key-file")
    if args.enrollment_token_file is not None:
        read_tokens(args.enrollment_token_file)
    return ClientKeys(load_key_pair(args.curve_key_file, "--curve-key-file"),
                      load_public_key(args.scheduler_public_key_file, "--scheduler-public-key-file"))


def parse_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ExecutorConfig:
    environ = os.environ if environ is None else environ
    parser = build_arg_parser()
    args = parse_with_env(parser, argv, environ)
    try:
        ranks = rank_env(args.tensor_parallel_size, environ)
        # Read now, not after the model loaded: a bad key file fails in a second, not minutes.
        keys = _link_keys(args)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    if args.quantization is not None and (args.device != "cpu" or args.tensor_parallel_size > 1
                                          or args.dtype == "float16"):
        parser.error(f"--quantization {args.quantization}: CPU executors with one rank and --dtype auto, float32 "
                     f"or bfloat16 only (got --device {args.device}, --tensor-parallel-size "
                     f"{args.tensor_parallel_size}, --dtype {args.dtype})")
    if args.enable_lora and not 1 <= args.max_lora_rank <= 256:
        parser.error(f"--max-lora-rank: must be in [1, 256], got {args.max_lora_rank}")
    if args.enable_lora and args.max_loras > wire.MAX_LORA_SLOTS:
        parser.error(f"--max-loras: at most {wire.MAX_LORA_SLOTS}, got {args.max_loras}")
    max_cpu_loras = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if args.enable_lora and max_cpu_loras < args.max_loras:
        parser.error(f"--max-cpu-loras ({max_cpu_loras}) must be >= --max-loras ({args.max_loras}): every adapter "
                     f"in a slot is kept in host memory too")
    if args.enable_lora and args.lora_dtype == "bfloat16" and args.device != "cpu":
        parser.error(f"--lora-dtype bfloat16: the CUDA LoRA kernels read float32 slots (--device {args.device}); "
                     f"use float32 or auto")
    if args.prepare_ahead and args.tensor_parallel_size > 1:
        parser.error("--prepare-ahead: a tensor-parallel executor runs its steps in order (one device only)")
    model = resolve_model(Path(args.model))
    if args.speculative_model is not None:
        if args.tensor_parallel_size > 1:
            parser.error("--speculative-model: a tensor-parallel executor verifies n-gram proposals only (a draft "
                         "model would run on rank 0 alone, its tokens needed by every rank before the forward)")
        try:  # a draft that cannot serve the model stops the executor here, naming it
            check_draft(args.speculative_model, model)
        except ValueError as exc:
            parser.error(f"--speculative-model: {exc}")
    quantization = args.quantization
    if quantization == "gguf" and not is_gguf(model):
        parser.error(f"--quantization gguf: keeps a GGUF file's blocks, but --model {args.model} is not a GGUF file")
    if quantization is None and is_gguf(model) and args.device == "cpu" and args.dtype == "auto" \
            and args.tensor_parallel_size == 1:
        quantization = "gguf"  # a GGUF file's quantized layers stay quantized; --dtype float32 dequantizes them
    return ExecutorConfig(
        model_dir=model, scheduler=args.scheduler, device=args.device,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space, block_size=args.block_size, dtype=args.dtype,
        cpu_attention=args.cpu_attention,
        executor_id=args.executor_id or f"{socket.gethostname()}-{os.getpid()}",
        health_port=args.health_port, health_host=args.health_host, drain_timeout=args.drain_timeout,
        link_keys=keys, enrollment_token_file=args.enrollment_token_file, log_level=args.log_level,
        tensor_parallel_size=args.tensor_parallel_size, rank_env=ranks, prepare_ahead=args.prepare_ahead,
        cpu_threads=args.cpu_threads, cpu_decode_threads=args.cpu_decode_threads, quantization=quantization,
        warmup=args.warmup, decode_steps=args.decode_steps, enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes, batch_invariant=args.batch_invariant,
        max_loras=args.max_loras if args.enable_lora else 0, max_lora_rank=args.max_lora_rank,
        speculative_model=resolve_model(args.speculative_model) if args.speculative_model is not None else None,
        lora_dtype=args.lora_dtype if args.lora_dtype != "auto" else "bfloat16" if args.device == "cpu" else "float32",
        max_cpu_loras=max_cpu_loras if args.enable_lora else 0, fused_layers=args.fused_layers)


def _graph_sizes(text: str) -> tuple[int, ...]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
