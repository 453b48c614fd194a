"""--lora-modules as the scheduler reads it (pagedserve/lora_modules.py): both entry forms, and every
bad adapter refused at start with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.lora_modules import LoraConfigError, inspect_adapter, parse_lora_module
from scheduler_svc.entrypoints.service_config import load_config
from testing.peft_files import write_peft_dir


def test_entry_forms(tmp_path):
    assert parse_lora_module("sql=/adapters/sql") == ("sql", Path("/adapters/sql"), None)
    name, path, base = parse_lora_module('{"name": "chat", "path": "/a/chat", "base_model_name": "SmolLM2"}')
    assert (name, str(path), base) == ("chat", "/a/chat", "SmolLM2")
    for bad, words in [("sql", "name=path"), ("=/x", "1 to 128"), ('{"name": "x"}', "'name' and 'path'"),
                       ('{"name": "x", "path": "/p", "rank": 3}', "unknown field"), ("{not json", "not JSON")]:
        with pytest.raises(LoraConfigError, match=words):
            parse_lora_module(bad)


def test_one_environment_variable_holds_several_entries(tmp_path):
    from pagedserve.lora_modules import split_lora_modules

    assert split_lora_modules(["a=/x b=/y", '{"name": "c", "path": "/z w"}']) == \
        ["a=/x", "b=/y", '{"name": "c", "path": "/z w"}']
    assert split_lora_modules(['[{"name": "c", "path": "/z"}, "d=/w"]']) == ['{"name": "c", "path": "/z"}', "d=/w"]
    good = write_peft_dir(tmp_path / "good")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    cfg = load_config(["--model", str(model_dir)], {"PAGEDSERVE_ENABLE_LORA": "true",
                                                    "PAGEDSERVE_LORA_MODULES": f"a={good} b={good}"})
    assert [m.name for m in cfg.engine.lora_modules] == ["a", "b"]


def test_a_good_adapter_is_described(tmp_path):
    m = inspect_adapter("sql", write_peft_dir(tmp_path / "sql", r=8, targets=("v_proj", "q_proj", "down_proj")), 16)
    assert (m.rank, m.targets, m.base_model) == (8, ("q_proj", "v_proj", "down_proj"), "tiny-llama")


def _edit_config(d, **fields):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(fields)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "absent", "no such directory"),
    (lambda d: write_peft_dir(d / "a", r=32), "rank 32 is above --max-lora-rank 16"),
    (lambda d: _edit_config(write_peft_dir(d / "a"), target_modules=["q_proj", "lm_head"]),
     "target module(s) ['lm_head'] are not in the base model"),
    (lambda d: _edit_config(write_peft_dir(d / "a"), use_dora=True), "use_dora=True is not supported"),
    (lambda d: _edit_config(write_peft_dir(d / "a"), bias="all"), "bias='all' is not supported"),
    (lambda d: _edit_config(write_peft_dir(d / "a"), peft_type="IA3"), "peft_type 'IA3'"),
    (lambda d: _edit_config(write_peft_dir(d / "a"), r=4), "not rank 4"),
    (lambda d: (write_peft_dir(d / "a") / "adapter_config.json").write_text("{oops") and d / "a", "not JSON"),
    (lambda d: (write_peft_dir(d / "a") / "adapter_model.safetensors").unlink() or d / "a",
     "cannot read adapter_model.safetensors"),
])
def test_bad_adapters_are_refused_naming_the_problem(tmp_path, make, words):
    with pytest.raises(LoraConfigError) as e:
        inspect_adapter("x", make(tmp_path), 16)
    assert words in str(e.value) and "'x'" in str(e.value)


def test_truncated_and_corrupt_weights(tmp_path):
    d = write_peft_dir(tmp_path / "a")
    f = d / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-16])
    with pytest.raises(LoraConfigError, match="truncated"):
        inspect_adapter("x", d, 16)
    f.write_bytes(b"\xff" * 4)
    with pytest.raises(LoraConfigError, match="truncated"):
        inspect_adapter("x", d, 16)
    f.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(LoraConfigError, match="corrupt"):
        inspect_adapter("x", d, 16)


def test_the_scheduler_refuses_to_start_with_a_bad_adapter(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    good = write_peft_dir(tmp_path / "good")
    cfg = load_config(["--model", str(model_dir), "--enable-lora", "--lora-modules", f"good={good}"], {})
    assert [m.name for m in cfg.engine.lora_modules] == ["good"]
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--lora-modules", f"good={good}"], {})
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    bad = write_peft_dir(tmp_path / "bad", r=64)
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--enable-lora", "--lora-modules", f"good={good}", f"bad={bad}"], {})
    assert "rank 64 is above --max-lora-rank 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--enable-lora", "--lora-modules", f"a={good}", f"a={good}"], {})
    assert "a name given twice" in capsys.readouterr().err


def test_max_cpu_loras_is_taken_as_vllm_serve_takes_it_and_bounded_by_max_loras(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    base = ["--model", str(model_dir), "--enable-lora", "--max-loras", "4"]
    assert load_config(base, {}).engine.max_cpu_loras is None  # (each executor's default: its --max-loras)
    assert load_config([*base, "--max-cpu-loras", "4"], {}).engine.max_cpu_loras == 4
    with pytest.raises(SystemExit):
        load_config([*base, "--max-cpu-loras", "3"], {})
    assert "--max-cpu-loras (3) must be >= --max-loras (4)" in capsys.readouterr().err


def test_the_registry_gives_each_load_of_a_name_its_own_key(tmp_path):
    from pagedserve.kv_blocks import chain_root, lora_key
    from scheduler_svc.engine.lora_registry import LoraRegistry

    a, b = write_peft_dir(tmp_path / "a"), write_peft_dir(tmp_path / "b", r=4)
    reg = LoraRegistry((inspect_adapter("sql", a, 16),), 16)
    assert reg.names == ("sql",) and reg.paths == {"sql": str(a)} and reg.ids == {"sql": 0}
    reg.load("chat", str(b))
    with pytest.raises(LoraConfigError, match="already loaded"):
        reg.load("chat", str(a))
    with pytest.raises(LoraConfigError, match="rank 32 is above --max-lora-rank 16"):
        reg.load("big", str(write_peft_dir(tmp_path / "big", r=32)))
    first = reg.ids["chat"]
    reg.unload("chat")
    with pytest.raises(KeyError):
        reg.unload("chat")
    reg.load("chat", str(a))
    second = reg.ids["chat"]
    assert 0 < first < second and reg.paths == {"sql": str(a), lora_key("chat", second): str(a)}
    assert len({chain_root("chat", first), chain_root("chat", second), chain_root("sql"), chain_root(None)}) == 4


def test_a_name_that_looks_like_a_load_at_run_time_keeps_its_own_key(tmp_path):
    """``x#1`` given at start and ``x`` loaded at run time (id 1): two keys, each with its own files and
    chain; unloading ``x`` leaves ``x#1`` served from its files."""
    from pagedserve.kv_blocks import chain_root, lora_key
    from scheduler_svc.engine.lora_registry import LoraRegistry

    a, b = write_peft_dir(tmp_path / "a"), write_peft_dir(tmp_path / "b", r=4)
    reg = LoraRegistry((inspect_adapter("x#1", a, 16),), 16)
    reg.load("x", str(b))
    assert reg.ids == {"x#1": 0, "x": 1} and lora_key("x#1") != lora_key("x", 1)
    assert reg.paths == {lora_key("x#1"): str(a), lora_key("x", 1): str(b)}
    assert chain_root("x#1") != chain_root("x", 1)
    reg.unload("x")
    assert reg.paths == {lora_key("x#1"): str(a)}
    assert lora_key("a#b", 0) != lora_key("a", 0) and len({lora_key("a#2", 3), lora_key("a", 2), lora_key("a#2#3")}) == 3


def test_an_adapter_may_not_take_the_served_models_name():
    from pagedserve.lora_modules import check_not_base_model

    assert check_not_base_model("sql", "tiny-llama") == "sql"
    with pytest.raises(LoraConfigError) as exc:
        check_not_base_model("tiny-llama", "tiny-llama")
    assert str(exc.value) == ("LoRA adapter name 'tiny-llama' is the served model's name (requests naming it get "
                              "the base model); choose another")


def test_the_scheduler_refuses_to_start_with_an_adapter_named_as_the_model(tmp_path, capsys):
    model_dir = tmp_path / "tiny-llama"  # the served name: the model path's last part (executor_svc)
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    good = write_peft_dir(tmp_path / "good")
    with pytest.raises(SystemExit):
        load_config(["--model", str(model_dir), "--enable-lora", "--lora-modules", f"tiny-llama={good}"], {})
    assert "error: --lora-modules: LoRA adapter name 'tiny-llama' is the served model's name" in capsys.readouterr().err
    good_name = ["--model", str(model_dir), "--enable-lora", "--lora-modules", f"tiny-llama={good}",
                 "--served-model-name", "chat"]
    assert [m.name for m in load_config(good_name, {}).engine.lora_modules] == ["tiny-llama"]  # (not the model's)
    with pytest.raises(SystemExit):
        load_config([*good_name[:4], f"chat={good}", *good_name[5:]], {})
    assert "error: --lora-modules: LoRA adapter name 'chat' is the served model's name" in capsys.readouterr().err
