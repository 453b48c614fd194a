"""Which slice of every layer a tensor-parallel rank holds (Megatron-style, as vLLM shards Llama).

Rank ``r`` of ``N`` holds, in every layer:

- q heads ``[r * H/N, (r+1) * H/N)`` and the KV heads they read. With ``KV >= N`` that is KV
  heads ``[r * KV/N, (r+1) * KV/N)``; with ``KV < N`` each KV head is replicated on ``N/KV``
  ranks and rank ``r`` holds head ``r // (N/KV)`` (the one its q heads use under GQA);
- columns ``[r * I/N, (r+1) * I/N)`` of the MLP's intermediate features (gate and up rows);
- the matching input columns of ``o_proj`` and ``down_proj`` (row-parallel: each rank's partial
  product is summed over ranks by an all-reduce, the bias added once after it);
- the KV cache of its own KV heads only (``[num_blocks, block_size, KV_local, head_dim]``).

Embeddings and norms are replicated; the LM head lives on rank 0 only, which samples
(docs/ARCHITECTURE.md, "Tensor parallelism", says why not vocab-parallel).

A rank's model and KV cache are built from :meth:`TPShard.local_config`: a ``ModelConfig`` whose
head and intermediate counts are the rank's own, so the attention code, the KV sizing and the
GPU profiling need no notion of ranks at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from executor_svc.model.architecture import ModelConfig


@dataclass(frozen=True, slots=True)
class TPShard:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size}: need 0 <= rank < size")

    @property
    def holds_lm_head(self) -> bool:
        """Rank 0 samples, so it alone computes logits."""
        return self.rank == 0

    def check(self, cfg: ModelConfig) -> None:
        """ValueError, naming the flag and the model's numbers, when the model cannot split N ways."""
        n = self.size
        flag = f"--tensor-parallel-size {n}"
        if cfg.num_heads % n:
            raise ValueError(f"{flag}: the model's {cfg.num_heads} attention heads (num_attention_heads) do "
                             f"not split evenly over {n} ranks; use a size that divides {cfg.num_heads}")
        kv = cfg.num_kv_heads
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise ValueError(f"{flag}: the model's {kv} KV heads (num_key_value_heads) neither split evenly "
                             f"over {n} ranks nor replicate evenly ({n} must divide {kv} or be a multiple of it)")
        if cfg.intermediate_size % n:
            raise ValueError(f"{flag}: the model's intermediate_size {cfg.intermediate_size} does not split "
                             f"evenly over {n} ranks")

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first global q head, count) held by this rank."""
        per = cfg.num_heads // self.size
        return self.rank * per, per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first global KV head, count) held by this rank; count 1 when replicated."""
        kv = cfg.num_kv_heads
        if kv >= self.size:
            per = kv // self.size
            return self.rank * per, per
        return self.rank // (self.size // kv), 1

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first global intermediate feature, count) held by this rank."""
        per = cfg.intermediate_size // self.size
        return self.rank * per, per

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its own head and intermediate counts, the rest global."""
        self.check(cfg)
        return dataclasses.replace(cfg, num_heads=self.q_heads(cfg)[1], num_kv_heads=self.kv_heads(cfg)[1],
                                   intermediate_size=self.intermediate(cfg)[1])


NO_SHARD = TPShard()
