"""The scheduler's flags: PAGEDSERVE_* environment fallback, bounds named in errors, sizes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket

import pytest

from pagedserve.envargs import env_name, parse_bytes
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.entrypoints.service_config import load_config
from scheduler_svc.entrypoints.service_flags import (
    FLAG_FIELDS,
    RUNTIME_FIELDS,
    build_arg_parser,
    default,
)
from scheduler_svc.front.grpc.limits import GrpcLimits
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.peft_files import write_peft_dir


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_environment_fills_flags_the_command_line_did_not_give(model_dir):
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "32", "PAGEDSERVE_PREEMPTION_MODE": "swap",
           "PAGEDSERVE_DISABLE_PREFIX_CACHING": "true", "PAGEDSERVE_PORT": "6000"}
    cfg = load_config(["--model", str(model_dir), "--port", "7000"], env)
    assert cfg.scheduler.max_num_seqs == 32 and cfg.scheduler.preemption_mode == "swap"
    assert not cfg.scheduler.enable_prefix_caching
    assert cfg.port == 7000  # the command line wins


def test_http_api_port_and_host(model_dir):
    cfg = load_config(["--model", str(model_dir)], {})
    assert (cfg.http_host, cfg.http_port) == ("0.0.0.0", 8000)
    cfg = load_config(["--model", str(model_dir), "--http-host", "127.0.0.1"], {"PAGEDSERVE_HTTP_PORT": "0"})
    assert (cfg.http_host, cfg.http_port) == ("127.0.0.1", 0)  # 0: the HTTP API is off


def test_cors_is_off_unless_origins_are_given(model_dir):
    assert load_config(["--model", str(model_dir)], {}).cors is None
    cfg = load_config(["--model", str(model_dir), "--allowed-origins", "https://a.example", "https://b.example",
                       "--allowed-methods", "POST"], {})
    assert (cfg.cors.origins, cfg.cors.methods, cfg.cors.headers) == (("https://a.example", "https://b.example"),
                                                                      ("POST",), ("*",))


@pytest.mark.parametrize("argv,env,message", [
    (["--max-num-seqs", "0"], {}, "--max-num-seqs: must be > 0, got 0"),
    (["--port", "70000"], {}, "port: must be >= 0 and <= 65535, got 70000"),
    ([], {"PAGEDSERVE_MAX_MIGRATIONS": "-1"}, "--max-migrations: must be >= 0, got -1"),
    ([], {"PAGEDSERVE_PREEMPTION_MODE": "drop"}, "invalid choice: 'drop'"),
    ([], {"PAGEDSERVE_DISABLE_PREFIX_CACHING": "maybe"}, "PAGEDSERVE_DISABLE_PREFIX_CACHING: expected a boolean"),
    (["--stream-interval", "0"], {}, "--stream-interval: must be >= 1, got 0"),
    (["--served-model-name", " padded"], {}, "--served-model-name: 1 to 128 printable characters, no leading"),
    (["--served-model-name", "x" * 129], {}, "--served-model-name: 1 to 128 printable characters"),
    # (past what the links carry: a request at the limit would make a frame the receiver refuses)
    (["--max-logprobs", "1025"], {}, "--max-logprobs: must be >= 0 and <= 1024, got 1025"),
    (["--max-beam-width", "513"], {}, "--max-beam-width: must be > 0 and <= 512, got 513"),
    (["--allow-credentials"], {}, "--allow-credentials: only with --allowed-origins"),
    (["--allowed-origins", "*", "--allow-credentials"], {}, "--allow-credentials: name the origins (not *)"),
])
def test_bad_values_name_the_flag_and_the_limit(model_dir, capsys, argv, env, message):
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), *argv], env)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("env,message", [
    ({"PAGEDSERVE_MAX_NUM_SEQS": "abc"}, "error: PAGEDSERVE_MAX_NUM_SEQS: --max-num-seqs: expected an integer, got 'abc'"),
    ({"PAGEDSERVE_MAX_NUM_SEQS": "-3"}, "error: PAGEDSERVE_MAX_NUM_SEQS: --max-num-seqs: must be > 0, got -3"),
    ({"PAGEDSERVE_BLOCK_SIZE": "x"}, "error: PAGEDSERVE_BLOCK_SIZE: --block-size: invalid int value: 'x'"),
    ({"PAGEDSERVE_BLOCK_SIZE": "7"}, "error: PAGEDSERVE_BLOCK_SIZE: --block-size: invalid choice: 7 (choose from "),
    ({"PAGEDSERVE_PREEMPTION_MODE": "drop"},
     "error: PAGEDSERVE_PREEMPTION_MODE: --preemption-mode: invalid choice: 'drop' (choose from 'recompute', 'swap')"),
])
def test_a_bad_value_from_the_environment_names_the_variable(model_dir, capsys, env, message):
    with pytest.raises(SystemExit) as exc:
        load_config(["--model", str(model_dir)], env)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_model_directory_without_config_json_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_config(["--model", str(tmp_path)], {})
    assert "has no config.json" in capsys.readouterr().err


def test_async_scheduling_is_the_default_and_can_be_turned_off(model_dir):
    base = ["--model", str(model_dir)]
    assert load_config(base, {}).engine.async_scheduling
    assert not load_config([*base, "--no-async-scheduling"], {}).engine.async_scheduling
    assert not load_config(base, {"PAGEDSERVE_ASYNC_SCHEDULING": "false"}).engine.async_scheduling
    assert load_config([*base, "--async-scheduling"], {"PAGEDSERVE_ASYNC_SCHEDULING": "0"}).engine.async_scheduling


def test_sizes_and_env_names():
    assert parse_bytes("2GiB") == 2 * 1024**3 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_bytes("two gigs")
    assert env_name("--max-num-batched-tokens") == "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS"


def test_every_knob_has_one_flag_whose_default_is_the_declared_one():
    parser = build_arg_parser()
    actions = {o: a for a in parser._actions for o in a.option_strings}
    for cls in (SchedulerConfig, EngineConfig, ServerLimits, HttpLimits, GrpcLimits):
        for f in dataclasses.fields(cls):
            if (cls, f.name) in RUNTIME_FIELDS:
                continue
            flags = [flag for flag, target in FLAG_FIELDS.items() if target == (cls, f.name)]
            assert len(flags) == 1, f"{cls.__name__}.{f.name} must have exactly one flag, has {flags}"
            assert actions[flags[0]].default == default(cls, f.name), flags[0]


def test_every_flag_reaches_the_object_that_uses_it(model_dir, tmp_path):
    """Each knob set to a non-default value arrives in the built config (none is dropped on the way)."""
    values = {"--block-size": "32", "--max-num-seqs": "77", "--max-num-batched-tokens": "999",
              "--preemption-mode": "swap", "--watermark": "0.05", "--heartbeat-interval": "0.25",
              "--max-queued-requests": "11", "--max-migrations": "5", "--step-timeout": "7.5",
              "--stream-interval": "4", "--max-failed-steps": "5", "--orphan-timeout": "12.5",
              "--served-model-name": "chat-model"}
    values.update({flag: str(default(cls, name) + 3) for flag, (cls, name) in FLAG_FIELDS.items()
                   if cls in (ServerLimits, HttpLimits, GrpcLimits)})
    values.update({"--max-loras": "3", "--max-lora-rank": "32", "--max-cpu-loras": "5"})
    values["--max-in-flight-bytes"] = str(64 << 20)  # at least the largest request a front accepts
    argv = ["--model", str(model_dir), "--disable-prefix-caching", "--no-async-scheduling", "--batch-invariant",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--enable-lora", "--allow-runtime-lora-updating", "--lora-modules", f"sql={write_peft_dir(tmp_path / 'sql', r=8)}"]
    for flag, value in values.items():
        argv += [flag, value]
    cfg = load_config(argv, {})
    objects = {SchedulerConfig: cfg.scheduler, EngineConfig: cfg.engine, ServerLimits: cfg.limits,
               HttpLimits: cfg.http_limits, GrpcLimits: cfg.grpc_limits}
    for flag, (cls, name) in FLAG_FIELDS.items():
        got = getattr(objects[cls], name)
        assert got != default(cls, name), f"{flag} did not reach {cls.__name__}.{name}"
        if flag in values:
            assert str(got) == values[flag], flag


def test_vllm_batch_invariant_turns_the_mode_on_and_pagedserves_variable_wins(model_dir, capsys):
    base = ["--model", str(model_dir)]
    assert load_config(base, {}).engine.batch_invariant is False
    assert load_config(base, {"VLLM_BATCH_INVARIANT": "1"}).engine.batch_invariant is True
    assert load_config(base, {"VLLM_BATCH_INVARIANT": "0"}).engine.batch_invariant is False
    assert load_config(base, {"VLLM_BATCH_INVARIANT": "1", "PAGEDSERVE_BATCH_INVARIANT": "0"}).engine.batch_invariant is False
    assert load_config([*base, "--no-batch-invariant"], {"VLLM_BATCH_INVARIANT": "1"}).engine.batch_invariant is False
    with pytest.raises(SystemExit):
        load_config(base, {"VLLM_BATCH_INVARIANT": "maybe"})
    assert "VLLM_BATCH_INVARIANT: expected a boolean, got 'maybe'" in capsys.readouterr().err


def test_n_and_beam_width_limits_must_fit_a_step(model_dir, capsys):
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--max-num-seqs", "8", "--max-n", "9"], {})
    assert "--max-n: must be <= --max-num-seqs and --max-num-batched-tokens (8), got 9" in capsys.readouterr().err


@pytest.mark.parametrize("flags,env,widths", [
    (["--max-num-seqs", "8"], {}, (8, 8)),  # --max-n's default 16 was an error
    (["--max-num-seqs", "1", "--max-n", "1"], {}, (1, 1)),  # then --max-beam-width's 8
    (["--block-size", "8", "--max-num-batched-tokens", "7"], {}, (7, 7)),
    ([], {"PAGEDSERVE_MAX_NUM_SEQS": "4"}, (4, 4)),
    (["--max-num-seqs", "12"], {}, (12, 8)),  # (only what does not fit shrinks)
])
def test_n_and_beam_width_defaults_shrink_to_fit_a_step(model_dir, flags, env, widths):
    limits = load_config(["--model", str(model_dir), *flags], env).limits
    assert (limits.max_n, limits.max_beam_width) == widths


@pytest.mark.parametrize("flags,env,message", [
    (["--max-num-seqs", "8", "--max-n", "16"], {}, "--max-n: must be <= --max-num-seqs and --max-num-batched-tokens "
                                                   "(8), got 16"),
    (["--max-num-seqs", "1", "--max-beam-w", "4"], {}, "--max-beam-width: must be <= --max-num-seqs and "
                                                       "--max-num-batched-tokens (1), got 4"),  # (an abbreviation)
    (["--max-num-batched-tokens", "7"], {"PAGEDSERVE_MAX_BEAM_WIDTH": "8"}, "--max-beam-width: must be <= "
                                                                            "--max-num-seqs and --max-num-batched-tokens (7), got 8"),
])
def test_n_and_beam_width_given_that_do_not_fit_are_still_refused(model_dir, capsys, flags, env, message):
    with pytest.raises(SystemExit) as e:
        load_config(["--model", str(model_dir), *flags], env)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_executor_link_is_loopback_only_without_a_cluster_secret(model_dir, tmp_path, capsys):
    base = ["--model", str(model_dir)]
    assert load_config(base, {}).engine.executor_endpoint == "tcp://127.0.0.1:5556"
    with pytest.raises(SystemExit):
        load_config([*base, "--executor-host", "0.0.0.0"], {})
    assert "give --curve-secret-key-file (or --cluster-secret-file on one machine; or, knowingly, " \
           "--allow-insecure-executors)" in capsys.readouterr().err
    insecure = load_config([*base, "--executor-host", "0.0.0.0", "--allow-insecure-executors"], {})
    assert insecure.engine.executor_endpoint == "tcp://0.0.0.0:5556"
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    assert load_config([*base, "--cluster-secret-file", str(secret)], {}).engine.executor_endpoint \
        == "tcp://0.0.0.0:5556"
    secret.write_text("short")
    with pytest.raises(SystemExit):
        load_config([*base, "--cluster-secret-file", str(secret)], {})
    assert "must be at least 16 bytes" in capsys.readouterr().err


def test_an_api_key_file_must_hold_usable_keys_in_a_regular_file(model_dir, tmp_path, capsys):
    base, keys = ["--model", str(model_dir), "--api-key-file"], tmp_path / "keys"
    keys.write_text("# ours\n\n  " + "k" * 16 + "  \n")
    assert load_config([*base, str(keys)], {}).api_keys.authorizes("Bearer " + "k" * 16)

    def refused(path) -> str:
        with pytest.raises(SystemExit):
            load_config([*base, str(path)], {})
        return capsys.readouterr().err

    keys.write_text("k" * 16 + "\npassword\n")
    err = refused(keys)
    assert "line 2 of" in err and "at least 16 printable characters without spaces (got 8)" in err
    assert "password" not in err.replace(str(keys), "")  # the error never repeats a key
    keys.write_text("two words and more\n")
    assert "line 1 of" in refused(keys)
    keys.write_bytes(b"\xff" * 20)
    assert "is not UTF-8 text" in refused(keys)
    keys.write_text("# only a comment\n")
    assert "holds no key" in refused(keys)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block start-up for ever
    assert "must be a regular file" in refused(fifo)
    assert "Is a directory" in refused(tmp_path)
    assert "cannot read" in refused(tmp_path / "missing")


def test_the_cluster_secret_is_read_once_at_start_up(model_dir, tmp_path):
    """The keys come from the one read the configuration made: the engine never reads the file again,
    so a file that changes (or goes) between parsing and start-up cannot change or break them."""
    from pagedserve.wire.keys import derive_keys
    from testing.in_process_engine import Engine
    from testing.tokenizers import small_tokenizer

    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32 + b"\n")
    cfg = load_config(["--model", str(model_dir), "--cluster-secret-file", str(secret)], {})
    keys = derive_keys(b"s" * 32)
    assert cfg.engine.executor_link.server == keys.server
    assert cfg.engine.executor_link.fixed_keys == {keys.executor_public}  # the one shared executor identity
    assert b"s" * 32 not in repr(cfg).encode() and keys.server_secret.decode() not in repr(cfg)
    secret.write_text("short")  # changed after the flags were checked
    tok, eos = small_tokenizer()
    engine = Engine(cfg.engine, tok, (eos,))
    assert engine.hub.keys.server == keys.server


def test_the_executor_checks_its_cluster_secret_before_loading_the_model(tmp_path, capsys):
    from executor_svc.config import parse_config
    from pagedserve.wire.keys import derive_keys

    secret = tmp_path / "secret"
    secret.write_text("short")
    argv = ["--model", str(tmp_path / "no-model-here"), "--scheduler", "tcp://127.0.0.1:5556",
            "--cluster-secret-file", str(secret)]
    with pytest.raises(SystemExit):
        parse_config(argv, {})
    assert f"--cluster-secret-file: the secret in {secret} must be at least 16 bytes" in capsys.readouterr().err
    secret.write_text("e" * 40)
    assert parse_config(argv, {}).link_keys == derive_keys(b"e" * 40).client
    assert parse_config(argv[:4], {}).link_keys is None


def test_the_stream_interval_defaults_to_every_step_and_reads_the_environment(model_dir):
    assert load_config(["--model", str(model_dir)], {}).engine.stream_interval == 1
    assert load_config(["--model", str(model_dir)], {"PAGEDSERVE_STREAM_INTERVAL": "4"}).engine.stream_interval == 4


@pytest.fixture()
def key_files(tmp_path):
    """A scheduler key pair, one executor key pair trusted through a directory, a token, a revocation list."""
    from pagedserve.wire.enrollment import new_token
    from pagedserve.wire.key_files import write_key_pair

    keys = tmp_path / "keys"
    pairs = {"scheduler": write_key_pair(keys, "scheduler"), "ex0": write_key_pair(keys, "ex0")}
    (keys / "trusted").mkdir()
    (keys / "trusted" / "ex0.key").write_bytes((keys / "ex0.key").read_bytes())
    (keys / "token").write_text(new_token() + "\n")
    (keys / "revoked").write_text("# none yet\n")
    return keys, pairs


def test_identity_keys_key_the_link_and_open_it_on_every_interface(model_dir, key_files):
    keys, pairs = key_files
    cfg = load_config(["--model", str(model_dir), "--curve-secret-key-file", str(keys / "scheduler.key_secret"),
                       "--trusted-executor-keys", str(keys / "trusted")],
                      {"PAGEDSERVE_REVOKED_EXECUTOR_KEYS": str(keys / "revoked")})
    link = cfg.engine.executor_link
    assert link.server == pairs["scheduler"] and not link.fixed_keys
    assert (link.trusted_keys, link.revoked_keys, link.enrollment_tokens) == (keys / "trusted", keys / "revoked", None)
    assert cfg.engine.executor_endpoint == "tcp://0.0.0.0:5556"
    assert pairs["scheduler"].secret.decode() not in repr(cfg)


@pytest.mark.parametrize("flags,message", [
    (["--curve-secret-key-file", "{k}/scheduler.key_secret"],
     "--curve-secret-key-file: give --trusted-executor-keys or --enrollment-token-file, or no executor can join"),
    (["--trusted-executor-keys", "{k}/trusted"], "--trusted-executor-keys: needs --curve-secret-key-file"),
    (["--enrollment-token-file", "{k}/token"], "--enrollment-token-file: needs --curve-secret-key-file"),
    (["--cluster-secret-file", "{k}/token", "--curve-secret-key-file", "{k}/scheduler.key_secret"],
     "--cluster-secret-file: not with --curve-secret-key-file"),
    (["--curve-secret-key-file", "{k}/scheduler.key", "--enrollment-token-file", "{k}/token"],
     "--curve-secret-key-file: {k}/scheduler.key is not a secret key file"),
    (["--curve-secret-key-file", "{k}/scheduler.key_secret", "--trusted-executor-keys", "{k}"],
     "--trusted-executor-keys: {k}/ex0.key_secret holds a secret key: give the public .key file instead"),
    (["--curve-secret-key-file", "{k}/scheduler.key_secret", "--trusted-executor-keys", "{k}/token"],
     "--trusted-executor-keys: {k}/token, line 1: expected a 40-character z85 key"),
    (["--curve-secret-key-file", "{k}/scheduler.key_secret", "--enrollment-token-file", "{k}/revoked"],
     "--enrollment-token-file: {k}/revoked holds no token"),
    (["--curve-secret-key-file", "{k}/scheduler.key_secret", "--trusted-executor-keys", "{k}/trusted",
      "--revoked-executor-keys", "{k}/missing"], "--revoked-executor-keys: {k}/missing does not exist"),
])
def test_link_key_flags_are_checked_at_start_up_naming_the_flag(model_dir, key_files, capsys, flags, message):
    keys, _ = key_files
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), *(f.format(k=keys) for f in flags)], {})
    assert message.format(k=keys) in capsys.readouterr().err


def test_a_key_file_whose_two_keys_do_not_belong_together_is_refused(model_dir, key_files, capsys):
    keys, pairs = key_files
    text = (keys / "scheduler.key_secret").read_text().replace(pairs["scheduler"].public.decode(),
                                                               pairs["ex0"].public.decode())
    (keys / "mixed.key_secret").write_text(text)
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--curve-secret-key-file", str(keys / "mixed.key_secret"),
                     "--enrollment-token-file", str(keys / "token")], {})
    assert "the public key is not the secret key's" in capsys.readouterr().err


def test_the_executor_reads_its_own_key_pair_and_the_schedulers_public_key(key_files, tmp_path, capsys):
    from executor_svc.config import parse_config

    keys, pairs = key_files
    base = ["--model", str(tmp_path / "no-model-here"), "--scheduler", "tcp://127.0.0.1:5556"]
    own = ["--curve-key-file", str(keys / "ex0.key_secret")]
    server = ["--scheduler-public-key-file", str(keys / "scheduler.key")]
    cfg = parse_config([*base, *own, *server], {"PAGEDSERVE_ENROLLMENT_TOKEN_FILE": str(keys / "token")})
    assert cfg.link_keys.own == pairs["ex0"] and cfg.link_keys.server_public == pairs["scheduler"].public
    assert cfg.enrollment_token_file == keys / "token" and pairs["ex0"].secret.decode() not in repr(cfg)
    for argv, message in [
        ([*base, *own], "--curve-key-file: needs --curve-key-file and --scheduler-public-key-file"),
        ([*base, "--enrollment-token-file", str(keys / "token")], "--enrollment-token-file: needs --curve-key-file"),
        ([*base, *own, *server, "--cluster-secret-file", str(keys / "token")],
         "--cluster-secret-file: not with --curve-key-file, --scheduler-public-key-file"),
        ([*base, "--curve-key-file", str(keys / "ex0.key"), *server], "is not a secret key file"),
        ([*base, *own, "--scheduler-public-key-file", str(keys / "scheduler.key_secret")],
         "holds a secret key: give the public .key file instead"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(argv, {})
        assert message in capsys.readouterr().err, argv


def test_the_caps_are_sized_for_the_machine_unless_given_and_must_hold_one_request(model_dir, capsys):
    from scheduler_svc.front.guards.admission import sized_for_machine

    base = ["--model", str(model_dir)]
    cfg = load_config(base, {})
    assert cfg.limits == sized_for_machine(dataclasses.replace(cfg.limits, max_concurrent_calls=0,
                                                               max_in_flight_bytes=0))
    assert cfg.limits.max_concurrent_calls >= 256 and cfg.limits.max_in_flight_bytes >= 64 << 20
    given = load_config([*base, "--max-concurrent-calls", "300"], {"PAGEDSERVE_MAX_IN_FLIGHT_BYTES": str(9 << 20)})
    assert (given.limits.max_concurrent_calls, given.limits.max_in_flight_bytes) == (300, 9 << 20)
    with pytest.raises(SystemExit):
        load_config([*base, "--max-in-flight-bytes", str(1 << 20)], {})
    assert "--max-in-flight-bytes: must be >= the largest request a front accepts" in capsys.readouterr().err


def test_engine_cores_ports_must_not_meet(model_dir, capsys):
    """Core k listens on --executor-port + k and --front-link-port + k."""
    base = ["--model", str(model_dir), "--executor-port", "5556"]
    assert load_config([*base, "--engine-cores", "2", "--front-link-port", "5600"], {}).engine_cores == 2
    with pytest.raises(SystemExit):
        load_config([*base, "--engine-cores", "2", "--front-link-port", "5557"], {})
    assert "--front-link-port: 5557..5558 meets the engine cores' executor ports 5556..5557" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config([*base, "--engine-cores", "3", "--port", "5558"], {})
    assert "--port: 5558 is one of the engine cores' executor or front-link ports" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--port", "55051", "--http-port", "55051"], "--http-port: 55051 is also --port's port; give each its own"),
    (["--port", "55051", "--metrics-port", "55051"], "--metrics-port: 55051 is also --port's port; give each its own"),
    (["--http-port", "55052", "--metrics-port", "55052"],
     "--metrics-port: 55052 is also --http-port's port; give each its own"),
])
def test_no_two_public_ports_are_the_same(model_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        load_config(["--model", str(model_dir), *flags], {})
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_public_ports_of_zero_may_repeat(model_dir):
    """0 is "off" (HTTP, metrics) or "any free port" (gRPC): never a collision."""
    cfg = load_config(["--model", str(model_dir), "--port", "0", "--http-port", "0", "--metrics-port", "0"], {})
    assert (cfg.port, cfg.http_port, cfg.metrics_port) == (0, 0, 0)


def test_a_tls_key_that_is_not_the_certificates_is_refused_at_start(model_dir, tmp_path, capsys):
    """Each front failed to bind instead (grpc: "Failed to bind to address", the wrong cause)."""
    from testing.tls_certs import make_pki

    pki = make_pki(tmp_path)
    base = ["--model", str(model_dir), "--tls-cert-file", str(pki["server_cert"])]
    assert load_config([*base, "--tls-key-file", str(pki["server_key"])], {}).tls is not None
    with pytest.raises(SystemExit) as e:
        load_config([*base, "--tls-key-file", str(pki["client_key"])], {})
    assert e.value.code == 2
    assert (f"--tls-key-file: {pki['client_key']} is not the private key of the certificate in --tls-cert-file "
            f"{pki['server_cert']}") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config([*base, "--tls-key-file", str(pki["server_cert"])], {})  # a certificate, not a key
    assert f"--tls-key-file {pki['server_cert']}: not a PEM certificate and its unencrypted private key" \
        in capsys.readouterr().err


def test_a_client_ca_file_without_a_certificate_is_refused_at_start(model_dir, tmp_path, capsys):
    from testing.tls_certs import make_pki

    pki = make_pki(tmp_path)
    base = ["--model", str(model_dir), "--tls-cert-file", str(pki["server_cert"]), "--tls-key-file",
            str(pki["server_key"])]
    assert load_config([*base, "--tls-client-ca-file", str(pki["ca"])], {}).tls.client_ca_file == pki["ca"]
    with pytest.raises(SystemExit) as e:
        load_config([*base, "--tls-client-ca-file", str(pki["server_key"])], {})  # a key, not a certificate
    assert e.value.code == 2
    assert f"--tls-client-ca-file: {pki['server_key']} holds no PEM CA certificate" in capsys.readouterr().err


def test_the_fronts_share_the_machine_sized_caps(model_dir):
    """Each of N fronts sizes its caps for 1/N of the machine (they all run on it)."""
    from scheduler_svc.front.guards.admission import sized_for_machine
    from scheduler_svc.front.input.server_limits import ServerLimits

    auto = ServerLimits(max_concurrent_calls=0, max_in_flight_bytes=0)
    quarter = sized_for_machine(auto, memory_bytes=16 << 30, cpus=8, share=4)
    assert quarter == sized_for_machine(auto, memory_bytes=4 << 30, cpus=2)
    assert quarter.max_in_flight_bytes == (4 << 30) // 8 and quarter.max_concurrent_calls == 2048
    assert load_config(["--model", str(model_dir), "--api-server-count", "4"], {}).limits.max_concurrent_calls \
        <= load_config(["--model", str(model_dir)], {}).limits.max_concurrent_calls


@pytest.mark.parametrize("value,message", [
    ('{"method": "eagle"}', "method: must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens: must be an integer in 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: must be an integer in 1..16"),
    ('{"model": "/models/draft"}', "draft model /models/draft: no config.json"),
    ('{"model": "/models/draft", "prompt_lookup_min": 2}', "unknown field(s) ['prompt_lookup_min']"),
    ("ngram", "not a JSON object"),
])
def test_a_bad_speculative_config_is_refused_at_start_naming_the_field(model_dir, capsys, value, message):
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--speculative-config", value], {})
    assert message in capsys.readouterr().err


def test_the_speculative_config_also_comes_from_the_environment(model_dir):
    cfg = load_config(["--model", str(model_dir)],
                      {"PAGEDSERVE_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 5}'})
    assert cfg.scheduler.speculative.num_speculative_tokens == 5


@pytest.mark.parametrize("flags", [["--max-request-id-len", "600"], ["--front-id", "f" * 400]],
                         ids=["long-request-ids", "long-front-id"])
def test_a_front_whose_request_ids_the_core_would_refuse_does_not_start(model_dir, capsys, flags):
    """The core takes request ids of at most 512 characters: the front's id, ':' and the client's (with
    '-' and 8 hex digits when it repeats one in flight). One longer would make an Abort the core
    refuses, and the core drops the front that sent it with every request it holds."""
    from scheduler_svc.entrypoints.front import parse_front_args

    with pytest.raises(SystemExit):
        parse_front_args(["--core", "tcp://127.0.0.1:5600", "--model", str(model_dir), *flags])
    front_id = "f" * 400 if "--front-id" in flags else f"{socket.gethostname()}-{os.getpid()}"
    rid_len = 600 if "--max-request-id-len" in flags else 128
    assert (f"--front-id and --max-request-id-len: the engine core takes request ids of at most 512 characters: "
            f"the front's id ({len(front_id)} characters), ':', a client's of up to --max-request-id-len ({rid_len}) "
            "and '-' with 8 hex digits for one repeated while in flight; shorten either") in capsys.readouterr().err
