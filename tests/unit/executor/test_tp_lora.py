"""LoRA adapters on a tensor-parallel executor (issue #40): each rank holds its slice of every adapter
(executor_svc/lora/sharding.py), loads reach every rank with the plan, and a 2-rank group (ranks as
threads, gloo over loopback) decodes greedily exactly as one rank and as PEFT's merged model in
float32; a load that fails on one rank only fails on all of them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.config import parse_config
from executor_svc.lora import LoraError, LoraManager
from executor_svc.lora.adapter import load_adapter
from executor_svc.lora.served import LoraSlotsOfRunner
from executor_svc.lora.sharding import shard_adapter
from executor_svc.model import load_model_config
from executor_svc.parallel.shard import TPShard
from pagedserve.wire import LoraLoad
from testing.executor_plans import hf_greedy, make_runner
from testing.lora_adapters import make_adapter, torch_model
from testing.plan_driver import PlanDriver
from testing.tp_harness import tp_runner

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [(ALL, 8), (["q_proj", "v_proj", "down_proj"], 4), (["k_proj", "o_proj", "gate_proj", "up_proj"], 6)]
SEQ_SLOTS = {0: 0, 1: -1, 2: 2, 3: 1, 4: 0}  # sequence -> LoRA slot (-1: the base model)
NEW_TOKENS = 8


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {sid: _prompt(n, 50 + sid) for sid, n in zip(SEQ_SLOTS, (11, 5, 19, 3, 8), strict=True)}
MODELS = {"llama": None, "llama-1kv": 1}  # 4 KV heads split 2/2; 1 KV head replicated on both ranks


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, tiny_checkpoint, tmp_path_factory):
    kv = MODELS[request.param]
    path = tiny_checkpoint("llama", "tp", **({} if kv is None else {"num_key_value_heads": kv}))
    dirs, merged = [], []
    for slot, (targets, r) in enumerate(ADAPTERS):
        d = tmp_path_factory.mktemp(f"tp-lora-{request.param}-{slot}")
        merged.append(make_adapter(path, d, targets, r=r, alpha=2 * r, seed=30 + slot))
        dirs.append(d)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = {sid: hf_greedy(base if s < 0 else merged[s], PROMPTS[sid], NEW_TOKENS) for sid, s in SEQ_SLOTS.items()}
    return path, dirs, want


def _serve(runner, dirs) -> dict[int, list[int]]:
    drv = PlanDriver(runner)
    for sid, slot in SEQ_SLOTS.items():
        drv.add(sid, PROMPTS[sid], lora_slot=slot)
    loads = [LoraLoad(slot, f"adapter{slot}", str(d)) for slot, d in enumerate(dirs)]
    drv.step({sid: 7 for sid in SEQ_SLOTS}, lora_loads=loads)  # (the loads come with the first plan)
    drv.run_until(NEW_TOKENS, chunk=7)
    return {sid: drv.seqs[sid].outputs for sid in SEQ_SLOTS}


def test_the_refusal_at_start_is_gone():
    cfg = parse_config(["--model", "m", "--scheduler", "tcp://h:5556", "--tensor-parallel-size", "2",
                        "--enable-lora", "--max-loras", "3"], {})
    assert cfg.tensor_parallel_size == 2 and cfg.max_loras == 3


def test_each_rank_holds_its_slice_and_the_slices_make_the_whole(setup):
    """Column-parallel: the ranks' B rows stacked are the whole B. Row-parallel: the ranks' partial
    deltas (x_r A_r^T) B^T sum to the whole delta."""
    path, dirs, _ = setup
    cfg = load_model_config(path)
    whole = load_adapter(dirs[0], cfg, 16)
    parts = [shard_adapter(whole, TPShard(r, 2), cfg) for r in range(2)]
    hd = cfg.head_dim
    for (layer, module), (a, b) in whole.weights.items():
        pa = [p.weights[layer, module][0] for p in parts]
        pb = [p.weights[layer, module][1] for p in parts]
        if module in ("o_proj", "down_proj"):
            assert all(torch.equal(x, b) for x in pb)
            x = torch.randn(3, a.shape[1])
            cut = torch.tensor_split(x, 2, dim=1)
            summed = sum((xr @ ar.t()) @ b.t() for xr, ar in zip(cut, pa, strict=True))
            assert torch.allclose(summed, (x @ a.t()) @ b.t(), atol=1e-5)
        else:
            assert all(torch.equal(x, a) for x in pa)
            if module in ("k_proj", "v_proj") and cfg.num_kv_heads == 1:  # replicated: both ranks hold it all
                assert all(torch.equal(x, b) for x in pb)
            else:
                assert torch.equal(torch.cat(pb), b)
        if module == "q_proj":
            assert pb[1].shape[0] == cfg.num_heads // 2 * hd


@pytest.mark.parametrize("packed", [True, False], ids=["packed_c", "torch"])
def test_tp2_greedy_equals_one_rank_and_peft(setup, packed):
    """Packed: the CPU ranks' C layers (the wrapper adds the delta to the row-parallel partial product);
    torch: plain layers, whose row-parallel path (as on CUDA) calls the wrapper's ``add_lora``."""
    path, dirs, want = setup
    one = make_runner(path) if packed else make_runner(path, model=torch_model(path), cpu_attention="torch")
    one.lora = LoraSlotsOfRunner(LoraManager(one.model, 3, 8))
    assert _serve(one, dirs) == want
    with tp_runner(path, lora=(3, 8), packed=packed) as runner:
        assert _serve(runner, dirs) == want
        runner.settle()
        for f in runner.followers:  # every rank loaded every adapter, its own slice of it
            assert f.lora.manager.loaded() == runner.lora.manager.loaded() == {s: str(d) for s, d in enumerate(dirs)}
            q = f.lora.manager.slots.layers[0]["qkv_proj"]
            assert q.bt.shape[2] == f.model.cfg.num_heads * f.model.cfg.head_dim + 2 * f.model.cfg.num_kv_heads * \
                f.model.cfg.head_dim


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(setup):
    path, dirs, want = setup
    with tp_runner(path, lora=(3, 8)) as runner:
        follower = runner.followers[0]
        real = follower.lora.manager.load

        def flaky(slot, where, key=None):  # the volume lost the file on rank 1's node only
            if slot == 1:
                raise LoraError(f"LoRA adapter {where}: adapter_config.json not found")
            return real(slot, where, key)

        follower.lora.manager.load = flaky
        drv = PlanDriver(runner)
        drv.add(0, PROMPTS[0], lora_slot=0)
        drv.add(3, PROMPTS[3], lora_slot=1)
        res = drv.step({0: 64, 3: 64}, expect_ok=False,
                       lora_loads=[LoraLoad(0, "adapter0", str(dirs[0])), LoraLoad(1, "adapter1", str(dirs[1]))])
        assert [(f.slot, "another tensor-parallel rank" in f.reason) for f in res.lora_failures] == [(1, True)]
        assert res.failed_seq_ids == [3] and res.sampled_seq_ids == [0]
        del drv.seqs[3]
        drv.run_until(NEW_TOKENS)  # the other adapter's sequence goes on, on both ranks
        assert drv.seqs[0].outputs == want[0]
        runner.settle()
        assert 1 in follower.lora.failed and 1 in runner.lora.failed
        assert set(follower.seqs) == set(runner.seqs) == {0}
