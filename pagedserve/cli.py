"""`pagedserve`: command-line client of the pagedserve.v1 gRPC API.

    pagedserve [--server HOST:PORT] generate "prompt" --max-tokens 32 --stream
    pagedserve info
    pagedserve stats
    pagedserve health
    pagedserve keys executor --out DIR   (the executor link's keys: pagedserve/keytool.py)

Generated text goes to stdout; finish reasons and token counts to stderr, so
``pagedserve generate ... > out.txt`` keeps only the text. ``--json`` prints
the server's messages as JSON lines instead. Exit status: 0 on success, 1 when
the server refused or failed (the gRPC status code and message are printed),
2 for bad command-line usage (argparse checks each number against its proto field's
range and reads the TLS files before anything is sent), 130 on Ctrl-C (the request is cancelled).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TextIO

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import keytool
from pagedserve.channel import open_channel
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_SERVER = "localhost:50051"
# The ranges of the proto fields the integer flags fill (generation.proto): a value outside them
# would make protobuf raise, so argparse refuses it first. Ids and counts are never negative.
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve", description="Client of a pagedserve server.")
    p.add_argument("--server", default=os.environ.get("PAGEDSERVE_SERVER", DEFAULT_SERVER),
                   help="HOST:PORT of the scheduler (env PAGEDSERVE_SERVER; default %(default)s)")
    p.add_argument("--timeout", type=_positive_seconds, default=None, help="deadline in seconds for the call (> 0)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="API key sent as 'authorization: Bearer <key>' (env PAGEDSERVE_API_KEY)")
    p.add_argument("--tls-ca", type=_readable_file, default=os.environ.get("PAGEDSERVE_TLS_CA"),
                   help="PEM CA bundle to verify the server with: connect over TLS (env PAGEDSERVE_TLS_CA)")
    p.add_argument("--tls-cert", type=_readable_file, default=None, help="client certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", type=_readable_file, default=None, help="private key of --tls-cert (PEM)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the server's messages as JSON")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", parents=[common], help="generate a completion")
    g.add_argument("prompt", nargs="?", help="text prompt (or use --token-ids)")
    g.add_argument("--token-ids", type=_int_list(0, INT32_MAX), help="comma-separated prompt token ids instead of a prompt")
    g.add_argument("--request-id", default="")
    g.add_argument("--max-tokens", type=_int_in(0, INT32_MAX), default=0, help="0: server default (16, capped by context)")
    g.add_argument("--stream", action="store_true",
                   help="print text as it is generated (one choice; with several, from --n or --beam-width, "
                        "each is printed when done)")
    for flag, typ in (("--temperature", float), ("--top-p", float), ("--top-k", _int_in(0, INT32_MAX)),
                      ("--min-p", float), ("--seed", _int_in(0, UINT64_MAX)), ("--length-penalty", float),
                      ("--logprobs", _int_in(0, INT32_MAX)),
                      ("--repetition-penalty", float), ("--presence-penalty", float),
                      ("--frequency-penalty", float)):
        g.add_argument(flag, type=typ, default=None)
    g.add_argument("--n", type=_int_in(0, INT32_MAX), default=0, help="number of choices")
    g.add_argument("--beam-width", type=_int_in(0, INT32_MAX), default=0, help="> 1: beam search")
    g.add_argument("--early-stopping", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_int_list(0, INT32_MAX), default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_cmd_generate)

    sub.add_parser("info", parents=[common], help="describe the served model").set_defaults(func=_cmd_info)
    sub.add_parser("stats", parents=[common], help="scheduler and KV-cache stats").set_defaults(func=_cmd_stats)
    sub.add_parser("health", parents=[common], help="readiness and liveness").set_defaults(func=_cmd_health)
    keytool.add_parser(sub)  # works offline: no server is called
    return p


# argparse prefixes each ArgumentTypeError with "argument --flag:", so the messages name the range only.
def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value
    return parse


def _int_list(lo: int, hi: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        bad = [v for v in values if not lo <= v <= hi]
        if bad:
            raise argparse.ArgumentTypeError(f"each must be in [{lo}, {hi}], got {bad[0]}")
        return values
    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    # grpc takes a deadline already past (<= 0) and reports DEADLINE_EXCEEDED as if the server were slow.
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _readable_file(text: str) -> Path:
    # Read once here so a missing or unreadable PEM file is a usage error, not a traceback in open_channel.
    try:
        Path(text).read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror}") from None
    return Path(text)


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    """The GenerateRequest the ``generate`` arguments describe (unset options stay unset)."""
    sp = pb.SamplingParams(max_tokens=args.max_tokens, n=args.n, beam_width=args.beam_width,
                           early_stopping=args.early_stopping, stop=args.stop,
                           stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "length_penalty", "logprobs",
                 "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(args, name)
        if value is not None:
            setattr(sp, name, value)
    req = pb.GenerateRequest(request_id=args.request_id, sampling=sp)
    if args.prompt is not None:
        req.prompt = args.prompt
    if args.token_ids:
        req.prompt_token_ids.extend(args.token_ids)
    return req


def _cmd_generate(channel: grpc.Channel, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.prompt is None and not args.token_ids:
        print("error: give a prompt or --token-ids", file=err)
        return 2
    stream = pb_grpc.GenerationStub(channel).Generate(build_request(args), timeout=args.timeout)
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list] = {}  # (--logprobs: each choice's tokens' log-probs, to stderr at the end)
    finish: dict[int, int] = {}
    usage = None
    # Text is written as it comes only when one choice is expected: several (n > 1, or the beams of
    # a beam search) would run together on one line, so each is printed as a block when done. Should
    # the server still send another choice, only the first is written as it comes.
    inline = args.stream and not args.json and max(args.n, 1) == 1 and args.beam_width <= 1
    inline_index: int | None = None
    try:
        for msg in stream:
            if args.json:
                print(_to_json(msg), file=out, flush=True)
            for c in msg.choices:
                texts.setdefault(c.index, []).append(c.text)
                if c.logprobs:
                    logprobs.setdefault(c.index, []).extend(c.logprobs)
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
                if inline and inline_index in (None, c.index):
                    inline_index = c.index
                    out.write(c.text)
                    out.flush()
            if msg.HasField("usage"):
                usage = msg.usage
    except KeyboardInterrupt:
        stream.cancel()
        raise
    if not args.json:
        _print_choices(texts, finish, inline, inline_index, out)
        _print_logprobs(logprobs, err)
        _print_summary(finish, usage, err)
    return 0


def _print_logprobs(logprobs: dict[int, list], err: TextIO) -> None:
    """Each choice's tokens (ids: the client has no tokenizer) with their log-probs and alternatives."""
    for index in sorted(logprobs):
        print(f"[logprobs of choice {index}: token id, log-prob, the most likely alternatives]", file=err)
        for lp in logprobs[index]:
            top = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in lp.top_logprobs)
            print(f"  {lp.token_id:>8} {lp.logprob:9.4f}" + (f"   {top}" if top else ""), file=err)


def _print_choices(texts: dict[int, list[str]], finish: dict[int, int], inline: bool, written: int | None,
                   out: TextIO) -> None:
    """Each choice as a block, headed by its index when there are several; ``written``: the choice
    already written as it came (``inline``: its line is ended here, and it is not printed again)."""
    if inline:
        out.write("\n")
    for index in sorted(texts):
        if index == written:
            continue
        if len(texts) > 1:
            print(f"--- choice {index} ({_reason(finish.get(index, 0))}) ---", file=out)
        print("".join(texts[index]), file=out)


def _print_summary(finish: dict[int, int], usage: pb.Usage | None, err: TextIO) -> None:
    reasons = ", ".join(f"{i}: {_reason(r)}" for i, r in sorted(finish.items()))
    line = f"[finish {reasons}]"
    if usage is not None:
        line += (f" [prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
                 f" cached_prompt_tokens={usage.cached_prompt_tokens}]")
    print(line, file=err)


def _reason(value: int) -> str:
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _cmd_info(channel: grpc.Channel, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
    _print_message(info, args.json, out)
    return 0


def _cmd_stats(channel: grpc.Channel, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    stats = pb_grpc.GenerationStub(channel).GetStats(pb.GetStatsRequest(), timeout=args.timeout)
    if args.json:
        _print_message(stats, True, out)
        return 0
    executors = list(stats.executors)
    _print_message(stats, False, out, skip=("executors",))
    print(f"executors: {len(executors)}", file=out)
    for e in executors:
        usage = e.kv_blocks_used / e.kv_blocks_total if e.kv_blocks_total else 0.0
        ranks = f" x{e.tensor_parallel_size} ranks" if e.tensor_parallel_size > 1 else ""
        print(f"  {e.id} [{e.state}]{ranks} kv {e.kv_blocks_used}/{e.kv_blocks_total} used ({usage:.1%}),"
              f" {e.kv_blocks_cached} cached, {e.kv_blocks_shared} shared; cpu {e.cpu_blocks_used}/"
              f"{e.cpu_blocks_total}; running {e.num_running}, waiting {e.num_waiting}", file=out)
    return 0


def _cmd_health(channel: grpc.Channel, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    result = {}
    for service in ("liveness", "", "pagedserve.v1.Generation"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=args.timeout)
        result[service or '""'] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if args.json:
        print(json.dumps(result), file=out)
    else:
        for service, status in result.items():
            print(f"{service}: {status}", file=out)
    return 0 if all(s == "SERVING" for s in result.values()) else 1


def _to_json(msg) -> str:
    return json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True))


def _print_message(msg, as_json: bool, out: TextIO, skip: tuple[str, ...] = ()) -> None:
    data = json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    for key in skip:
        data.pop(key, None)
    if as_json:
        print(json.dumps(data, indent=2), file=out)
        return
    for key, value in data.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        print(f"{key}: {value}", file=out)


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    args = _build_parser().parse_args(argv)
    out, err = out or sys.stdout, err or sys.stderr
    if args.command == "keys":
        return keytool.run(args, out, err)
    try:
        with open_channel(args.server, args.api_key, args.tls_ca, args.tls_cert, args.tls_key) as channel:
            return args.func(channel, args, out, err)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()} (server {args.server})", file=err)
        return 1
    except KeyboardInterrupt:
        print("interrupted; request cancelled", file=err)
        return 130


if __name__ == "__main__":
    sys.exit(main())
