"""The `pagedserve` client CLI against a real server over a fake engine."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from pagedserve.cli import main
from testing.grpc_fakes import FakeEngine, ServerThread, example_stats, make_tokenizer
from testing.stack import free_port


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(FakeEngine(make_tokenizer()))
    yield srv
    srv.stop()


@pytest.fixture()
def engine(server):
    server.engine.reset()
    return server.engine


def cli(server, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["--server", server.address, *argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_generate_stream_prints_text_and_summary(server, engine):
    engine.completions = ["Grüße aus München 🙂"]
    code, out, err = cli(server, "generate", "Hello", "--max-tokens", "30", "--stream", "--temperature", "0")
    assert code == 0 and out == "Grüße aus München 🙂\n"
    assert "eos" in err and "completion_tokens=" in err
    req = engine.requests[0]
    assert req.params.max_tokens == 30 and req.params.sampling.temperature == 0.0


def test_logprobs_asked_for_are_printed_to_stderr_the_text_alone_to_stdout(server, engine):
    engine.completions = ["ab"]
    code, out, err = cli(server, "generate", "Hi", "--logprobs", "2", "--temperature", "0")
    assert code == 0 and out == "ab\n"
    rows = [line.split() for line in err.splitlines() if line.startswith("  ")]
    ids = make_tokenizer().encode("ab", add_special_tokens=False).ids + [1]  # (the fake ends with EOS, id 1)
    assert [int(r[0]) for r in rows] == ids and all(float(r[1]) == -0.5 and len(r) == 4 for r in rows)
    assert "[logprobs of choice 0" in err
    assert "logprobs" not in cli(server, "generate", "Hi")[2]


def test_generate_options_reach_the_server(server, engine):
    engine.completions = ["one", "two"]
    code, out, err = cli(server, "generate", "--token-ids", "0,5,6", "--n", "2", "--top-p", "0.5",
                         "--top-k", "3", "--seed", "7", "--stop", "xyz", "--stop", "END", "--logprobs", "1",
                         "--ignore-eos")
    assert code == 0
    assert out == "--- choice 0 (eos) ---\none\n--- choice 1 (eos) ---\ntwo\n"
    p = engine.requests[0].params
    assert engine.requests[0].prompt_token_ids == [0, 5, 6]
    assert (p.n, p.sampling.top_p, p.sampling.top_k, p.sampling.seed, p.stop, p.sampling.logprobs, p.ignore_eos) == (
        2, 0.5, 3, 7, ["xyz", "END"], 1, True)


def test_generate_json_lines(server, engine):
    engine.completions = ["ab"]
    code, out, _ = cli(server, "generate", "Hi", "--json", "--beam-width", "2")
    lines = [json.loads(x) for x in out.splitlines()]
    assert code == 0 and "usage" in lines[-1] and all("usage" not in x for x in lines[:-1])
    assert "".join(c.get("text", "") for x in lines for c in x["choices"]) == "ab"
    assert engine.requests[0].params.beam_width == 2


def test_refusal_prints_status_code_and_message(server, engine):
    code, out, err = cli(server, "generate", "Hi", "--temperature", "-1")
    assert code == 1 and out == ""
    assert "INVALID_ARGUMENT" in err and "sampling.temperature" in err
    engine.mode = "queue_full"
    code, _, err = cli(server, "generate", "Hi")
    assert code == 1 and "RESOURCE_EXHAUSTED" in err


def test_info_and_stats(server, engine):
    code, out, _ = cli(server, "info")
    assert code == 0 and "model_name: tiny-test" in out and "vocab_size: 300" in out
    engine.engine_stats = example_stats()
    code, out, _ = cli(server, "stats")
    assert code == 0 and "num_preemptions: 7" in out and "gpu-1 [draining] x4 ranks kv" in out and "400/1000" in out
    assert "gpu-0 [ready] kv" in out  # one device: no rank count
    code, out, _ = cli(server, "stats", "--json")
    data = json.loads(out)
    assert data["prefix_cache_hit_tokens"] == "640" and len(data["executors"]) == 2
    assert data["executors"][1]["tensor_parallel_size"] == 4


def test_health(server, engine):
    engine.ready = False
    server.call(server.api.update_health())
    code, out, _ = cli(server, "health")
    assert code == 1 and "pagedserve.v1.Generation: NOT_SERVING" in out and "liveness: SERVING" in out
    engine.ready = True
    server.call(server.api.update_health())
    assert cli(server, "health")[0] == 0


def test_missing_prompt_and_unreachable_server():
    err = io.StringIO()
    assert main(["generate"], out=io.StringIO(), err=err) == 2 and "prompt" in err.getvalue()
    port = free_port()  # a port nobody listens on
    err = io.StringIO()
    assert main(["--server", f"127.0.0.1:{port}", "info"], out=io.StringIO(), err=err) == 1
    assert "UNAVAILABLE" in err.getvalue()


def test_runs_as_a_program(server, engine):
    env = {**os.environ, "PAGEDSERVE_SERVER": server.address}
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "info", "--json"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["architecture"] == "LlamaForCausalLM"


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--seed", "-1"], "argument --seed: must be in [0, 18446744073709551615], got -1"),
    (["generate", "hi", "--seed", "18446744073709551616"],
     "argument --seed: must be in [0, 18446744073709551615], got 18446744073709551616"),
    (["generate", "hi", "--max-tokens", "3000000000"], "argument --max-tokens: must be in [0, 2147483647], got 3000000000"),
    (["generate", "hi", "--top-k", "99999999999"], "argument --top-k: must be in [0, 2147483647], got 99999999999"),
    (["generate", "hi", "--logprobs", "99999999999"], "argument --logprobs: must be in [0, 2147483647], got 99999999999"),
    (["generate", "hi", "--n", "-1"], "argument --n: must be in [0, 2147483647], got -1"),
    (["generate", "hi", "--beam-width", "99999999999"],
     "argument --beam-width: must be in [0, 2147483647], got 99999999999"),
    (["generate", "hi", "--stop-token-ids", "5,99999999999"],
     "argument --stop-token-ids: each must be in [0, 2147483647], got 99999999999"),
    (["generate", "--token-ids", "99999999999"], "argument --token-ids: each must be in [0, 2147483647], got 99999999999"),
    (["generate", "hi", "--top-k", "x"], "argument --top-k: expected an integer in [0, 2147483647], got 'x'"),
    (["--timeout=-1", "info"], "argument --timeout: must be a finite number of seconds > 0, got -1"),
    (["--timeout", "0", "info"], "argument --timeout: must be a finite number of seconds > 0, got 0"),
    (["--timeout", "nan", "info"], "argument --timeout: must be a finite number of seconds > 0, got nan"),
    (["--tls-ca", "/nonexistent", "info"], "argument --tls-ca: cannot read /nonexistent: No such file or directory"),
    (["--tls-cert", "/nonexistent", "info"], "argument --tls-cert: cannot read /nonexistent: No such file or directory"),
    (["--tls-key", "/nonexistent", "info"], "argument --tls-key: cannot read /nonexistent: No such file or directory"),
])
def test_bad_flags_are_usage_errors_naming_flag_and_range(argv, message, capsys):
    # Refused by argparse before any server is called (none listens on this address).
    with pytest.raises(SystemExit) as exc:
        main(["--server", "127.0.0.1:1", *argv], out=io.StringIO(), err=io.StringIO())
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


def test_largest_values_in_range_reach_the_server(server, engine):
    engine.completions = ["x"]
    code, _, err = cli(server, "--timeout", "30", "generate", "--token-ids", "0", "--seed", "0", "--top-k",
                       str(2**31 - 1))
    assert code == 0, err
    assert engine.requests[0].params.sampling.top_k == 2**31 - 1


def _two_choices(engine, monkeypatch):
    """The engine answers with two choices, their deltas interleaved (as beams or n > 1 come)."""
    from pagedserve.engine_api import ChoiceDelta, FinishReason, RequestOutput, Usage

    async def stream(req):
        yield RequestOutput(req.request_id, [ChoiceDelta(0, "one"), ChoiceDelta(1, "three")])
        yield RequestOutput(req.request_id, [ChoiceDelta(0, " two", finish_reason=FinishReason.LENGTH),
                                             ChoiceDelta(1, " four", finish_reason=FinishReason.EOS)],
                            usage=Usage(2, 4, 0), finished=True)

    monkeypatch.setattr(engine, "_stream", stream)  # (undone after the test: the server is shared)


@pytest.mark.parametrize("stream", [["--stream"], []])
def test_several_beams_are_printed_apart(server, engine, stream, monkeypatch):
    _two_choices(engine, monkeypatch)
    code, out, err = cli(server, "generate", "hello there", "--beam-width", "2", "--max-tokens", "4", *stream)
    assert code == 0
    assert out == "--- choice 0 (length) ---\none two\n--- choice 1 (eos) ---\nthree four\n"
    assert err.startswith("[finish 0: length, 1: eos]")


def test_a_choice_the_server_adds_to_a_stream_of_one_is_printed_apart(server, engine, monkeypatch):
    _two_choices(engine, monkeypatch)
    code, out, _ = cli(server, "generate", "hello there", "--max-tokens", "4", "--stream")
    assert code == 0 and out == "one two\n--- choice 1 (eos) ---\nthree four\n"
