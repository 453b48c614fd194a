"""Adapters kept in host memory (--max-cpu-loras, executor_svc/lora/cache.py): a slot loading an
adapter seen recently takes it from memory (no file read), the least recently used goes first,
never more than the bound; a name loaded again at run time (another id) is read from its files,
never served from the old entry; the flags' errors name both flags."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from executor_svc.config import parse_config
from executor_svc.lora import LoraError, LoraManager
from executor_svc.lora.adapter import LoraAdapter
from executor_svc.lora.cache import AdapterCache
from executor_svc.lora.served import LoraSlotsOfRunner
from executor_svc.model import load_model
from pagedserve import wire
from testing.peft_files import write_peft_dir

BASE = ["--model", "m", "--scheduler", "tcp://127.0.0.1:5556"]


def _adapter(tag: str) -> LoraAdapter:
    return LoraAdapter(tag, 1, 1.0, {})


def _reader(tag: str, reads: list[str]):
    def read() -> LoraAdapter:
        reads.append(tag)
        return _adapter(tag)
    return read


def test_hits_misses_and_least_recently_used_order():
    cache, reads = AdapterCache(2), []
    a, hit = cache.get("a", "/a", _reader("a", reads))
    assert not hit and reads == ["a"]
    cache.put("a", "/a", a)
    b, _ = cache.get("b", "/b", _reader("b", reads))
    cache.put("b", "/b", b)
    again, hit = cache.get("a", "/a", _reader("a", reads))
    assert hit and again is a and reads == ["a", "b"]  # from memory: not read again
    assert cache.keys() == [("b", "/b"), ("a", "/a")]  # a just used: b is the oldest
    cache.put("c", "/c", _adapter("c"))
    assert cache.keys() == [("a", "/a"), ("c", "/c")]  # the bound: b went
    _, hit = cache.get("b", "/b", _reader("b", reads))
    assert not hit and reads == ["a", "b", "b"]
    assert (cache.hits, cache.misses) == (1, 3)
    _, hit = cache.get("a", "/elsewhere", _reader("a2", reads))  # same key, another path: another adapter
    assert not hit


def test_a_cache_of_nothing_and_bad_sizes():
    cache = AdapterCache(0)
    cache.put("a", "/a", _adapter("a"))
    assert cache.keys() == []
    for bad in (-1, 1.5, True):
        with pytest.raises(LoraError, match="max_cpu_loras"):
            AdapterCache(bad)


def _write(path, seed: int):
    """A PEFT adapter of the small Llama (q_proj, o_proj of 2 layers) with values of ``seed``."""
    write_peft_dir(path, r=4, targets=("q_proj", "o_proj"), layers=2, width=64)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "o_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(4, 64, generator=g)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(64, 4, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)  # (one LoraManager per model)


def _slot_a(manager: LoraManager, slot: int) -> torch.Tensor:
    return manager.slots.layers[0]["qkv_proj"].a[slot].clone()


def test_a_slot_loads_a_kept_adapter_without_reading_its_files(model, tmp_path):
    manager = LoraManager(model, max_loras=2, max_rank=8, max_cpu_loras=3)
    d = _write(tmp_path / "sql", seed=1)
    assert manager.load(0, str(d), key="sql") is False  # read from its files
    first = _slot_a(manager, 0)
    manager.unload(0)
    shutil.rmtree(d)  # nothing left to read
    assert manager.load(1, str(d), key="sql") is True
    assert torch.equal(_slot_a(manager, 1), first)
    assert manager.cache.keys() == [("sql", str(d))]
    with pytest.raises(LoraError, match="not a directory"):
        manager.load(0, str(d))  # no key: read (and not kept)


def test_a_name_loaded_again_at_run_time_is_read_again(model, tmp_path):
    """Its new load has another id (``name#id``): the new files, never the old entry."""
    manager = LoraManager(model, max_loras=1, max_rank=8, max_cpu_loras=4)
    d = _write(tmp_path / "sql", seed=1)
    manager.load(0, str(d), key="sql#1")
    old = _slot_a(manager, 0)
    _write(d, seed=2)  # the same path, other weights, loaded again under the same name
    assert manager.load(0, str(d), key="sql#2") is False
    new = _slot_a(manager, 0)
    assert not torch.equal(new, old)
    assert manager.load(0, str(d), key="sql#2") is True and torch.equal(_slot_a(manager, 0), new)


def test_a_refused_adapter_takes_no_place_and_reset_forgets_all(model, tmp_path):
    manager = LoraManager(model, max_loras=2, max_rank=8, max_cpu_loras=2)
    runner_side = LoraSlotsOfRunner(manager)
    good = _write(tmp_path / "good", seed=3)
    bad = write_peft_dir(tmp_path / "bad", r=16, targets=("q_proj",), layers=1, width=64)  # rank 16 > 8
    runner_side.load(wire.LoraLoad(0, "good#1", str(good)), [])
    runner_side.load(wire.LoraLoad(1, "bad", str(bad)), [])
    assert 1 in runner_side.failed
    assert manager.cache.keys() == [("good#1", str(good))]  # the plan's name is the key
    runner_side.reset()  # a scheduler started again numbers its loads from 1 again
    assert manager.cache.keys() == []


def test_the_bound_and_the_flags(model, capsys):
    with pytest.raises(LoraError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoraManager(model, max_loras=2, max_rank=8, max_cpu_loras=1)
    assert model.lora is None  # refused before anything was installed
    lora = [*BASE, "--enable-lora", "--max-loras", "3"]
    cfg = parse_config(lora, {})
    assert cfg.max_cpu_loras == 3 and cfg.lora_dtype == "bfloat16"  # defaults: --max-loras; bfloat16 on CPU
    cfg = parse_config([*lora, "--max-cpu-loras", "10", "--lora-dtype", "float32"], {})
    assert cfg.max_cpu_loras == 10 and cfg.lora_dtype == "float32"
    assert parse_config([*lora, "--device", "cuda"], {}).lora_dtype == "float32"
    assert parse_config(BASE, {}).max_cpu_loras == 0  # no LoRA: no cache
    with pytest.raises(SystemExit):
        parse_config([*lora, "--max-cpu-loras", "2"], {})
    assert "--max-cpu-loras (2) must be >= --max-loras (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the CUDA kernels read float32 slots
        parse_config([*lora, "--device", "cuda", "--lora-dtype", "bfloat16"], {})
    assert "--lora-dtype bfloat16: the CUDA LoRA kernels read float32 slots" in capsys.readouterr().err
