"""A draft model's configuration errors, each refused at start naming the draft: a vocabulary of
another size or another tokenizer (scheduler and executor flags alike), and a draft on one side of
the executor link only (the handshake is refused, saying which side lacks it)."""

from __future__ import annotations

import json
import shutil

import pytest

from executor_svc.config import parse_config
from pagedserve import wire
from pagedserve.draft_model import check_draft
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.entrypoints.service_config import load_config
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.fake_engine import run
from testing.in_process_engine import handshake_replies


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint):
    return tiny_checkpoint("llama", "small", seed=7, num_key_value_heads=1)


def _edited(src, dst, config=None, tokenizer=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(cfg)))
    if tokenizer is not None:
        tok = json.loads((dst / "tokenizer.json").read_text())
        tokenizer(tok)
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def _swap_two_tokens(tok):
    vocab = tok["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1])[100:102]]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def test_a_draft_with_the_models_tokenizer_passes(tiny_llama_dir, draft_dir):
    info = check_draft(draft_dir, tiny_llama_dir)
    assert info.vocab_size == 512 and info.name == draft_dir.resolve().name


@pytest.mark.parametrize("what, message", [
    ("vocab", "a vocabulary of 600 tokens, the served model"),
    ("tokenizer", "its tokenizer differs from the served model"),
])
def test_a_draft_of_another_vocabulary_is_refused_by_both_services(tmp_path, tiny_llama_dir, draft_dir, capsys,
                                                                   what, message):
    if what == "vocab":
        bad = _edited(draft_dir, tmp_path / "bad", config=lambda c: {**c, "vocab_size": 600})
    else:
        bad = _edited(draft_dir, tmp_path / "bad", tokenizer=_swap_two_tokens)
    with pytest.raises(ValueError, match=message):
        check_draft(bad, tiny_llama_dir)
    with pytest.raises(SystemExit):
        load_config(["--model", str(tiny_llama_dir), "--speculative-config",
                     json.dumps({"model": str(bad), "num_speculative_tokens": 3})], {})
    err = capsys.readouterr().err
    assert f"--speculative-config: draft model {bad}" in err and message in err
    with pytest.raises(SystemExit):
        parse_config(["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:5556",
                      "--speculative-model", str(bad)], {})
    err = capsys.readouterr().err
    assert f"--speculative-model: draft model {bad}" in err and message in err


def test_the_draft_form_comes_from_the_flag_and_the_environment(tiny_llama_dir, draft_dir):
    value = json.dumps({"model": str(draft_dir), "num_speculative_tokens": 3})
    for argv, env in ((["--speculative-config", value], {}), ([], {"PAGEDSERVE_SPECULATIVE_CONFIG": value})):
        cfg = load_config(["--model", str(tiny_llama_dir), *argv], env)
        assert cfg.scheduler.speculative == SpeculativeConfig(method="draft_model", model=str(draft_dir),
                                                              num_speculative_tokens=3)
    ex = parse_config(["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:5556",
                       "--speculative-model", str(draft_dir)], {})
    assert ex.speculative_model == draft_dir


def test_a_tensor_parallel_executor_refuses_a_draft(tiny_llama_dir, draft_dir, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:5556",
                      "--speculative-model", str(draft_dir), "--tensor-parallel-size", "2"], {})
    assert "--speculative-model: a tensor-parallel executor verifies n-gram proposals only" in capsys.readouterr().err


def _hs(name: str, draft: str = "", draft_vocab: int = 0, speculative: bool = True) -> wire.Handshake:
    return wire.Handshake(name, wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 64, 0, 4096,
                          "float32", "cpu", speculative=speculative, draft_model=draft, draft_vocab_size=draft_vocab)


async def _replies(spec: SpeculativeConfig | None, handshakes: list[wire.Handshake]) -> list[wire.HandshakeReply]:
    cfg = EngineConfig(scheduler=SchedulerConfig(speculative=spec), executor_endpoint="tcp://127.0.0.1:0",
                       heartbeat_interval_s=0.2)
    return await handshake_replies(cfg, handshakes)


def test_a_draft_on_one_side_of_the_link_only_is_refused_naming_it():
    draft = SpeculativeConfig(method="draft_model", model="/models/smol-draft", num_speculative_tokens=3)
    replies = run(_replies(draft, [_hs("none"), _hs("other", "other-draft", 512), _hs("small-vocab", "smol-draft", 500),
                                   _hs("no-spec", "smol-draft", 512, speculative=False), _hs("ok", "smol-draft", 512)]))
    assert [r.accepted for r in replies] == [False, False, False, False, True]
    assert "names draft model 'smol-draft' and this executor holds none" in replies[0].reason
    assert "draft model 'other-draft', the scheduler's --speculative-config names 'smol-draft'" in replies[1].reason
    assert "vocabulary of 500" in replies[2].reason and "does not speculate" in replies[3].reason
    ngram = SpeculativeConfig(num_speculative_tokens=3)
    for spec in (None, ngram):
        (reply,) = run(_replies(spec, [_hs("drafty", "smol-draft", 512)]))
        assert not reply.accepted and "names no draft model" in reply.reason


def test_the_executor_counts_both_models_bytes_per_block_and_names_its_draft(tiny_llama_dir, draft_dir, capsys):
    from executor_svc.__main__ import build_runner
    from executor_svc.kv_cache import bytes_per_block

    base = ["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:1", "--kv-cache-memory", "4MiB",
            "--swap-space", "1MiB", "--no-warmup"]
    plain, plain_hs = build_runner(parse_config(base, {}))
    runner, hs = build_runner(parse_config([*base, "--speculative-model", str(draft_dir)], {}))
    per = (bytes_per_block(runner.model.cfg, 16, runner.kv.dtype)
           + bytes_per_block(runner.draft.model.cfg, 16, runner.kv.dtype))
    assert hs.num_device_blocks == (4 << 20) // per < plain_hs.num_device_blocks
    assert hs.num_cpu_blocks == (1 << 20) // per
    assert runner.draft.kv.num_blocks == runner.kv.num_blocks and runner.draft.kv.num_cpu_blocks == hs.num_cpu_blocks
    assert (hs.draft_model, hs.draft_vocab_size) == (draft_dir.resolve().name, 512) and not plain_hs.draft_model
    with pytest.raises(ValueError, match="less than one block of the model and its draft model"):
        build_runner(parse_config([*base[:-5], "--kv-cache-memory", "1KiB", "--speculative-model", str(draft_dir)],
                                  {}))
