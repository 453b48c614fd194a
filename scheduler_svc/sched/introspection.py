"""What a scheduler's state looks like from outside, without changing it: counters and checks.

The counters are what the engine's ``GetStats`` and its placement read (every one O(1): they may
be read at any rate); the tests run :meth:`Introspection.check_integrity` after every step: the
queues, the sequence index, the LoRA pins, the placeholders the plans in flight owe and the KV
pools must all agree.
"""

from __future__ import annotations

from pagedserve.kv_blocks import lora_key
from scheduler_svc.sched.lifecycle import RequestLifecycle
from scheduler_svc.sched.request import RequestState


class Introspection(RequestLifecycle):
    """Read-only views of the queues, indexes and KV pools a :class:`RequestLifecycle` keeps."""

    def has_work(self) -> bool:
        return bool(self.requests or self._owed_frees)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.kv.stats().get("used", self.kv.num_device_blocks - self.kv.num_free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return self.kv.stats().get("cached", 0)

    @property
    def num_shared_blocks(self) -> int:
        return self.kv.stats().get("shared", 0)

    @property
    def num_cpu_used_blocks(self) -> int:
        return self.kv.stats().get("cpu_used", 0)

    def block_stats(self) -> dict[str, int]:
        """used / cached / shared device blocks and cpu_used (counters: GetStats reads them)."""
        return self.kv.stats()

    def check_integrity(self) -> None:
        """RuntimeError unless queues, sequences and the KV pools agree."""
        self.kv.check_integrity()
        queued = {id(r) for q in (self.waiting, self.running, self.swapped) for r in q}
        if len(queued) != len(self.requests) or any(id(r) not in queued for r in self.requests.values()):
            raise RuntimeError("every request must sit in exactly one queue")
        if [r.arrival for r in self.running] != sorted(r.arrival for r in self.running):
            raise RuntimeError("running queue is not in arrival order")
        live = {s.seq_id for r in self.requests.values() for s in r.live}
        if live != set(self.seqs):
            raise RuntimeError("live sequence index disagrees with the requests")
        for r in self.waiting:
            for s in r.live:
                if s.resident or s.num_computed_tokens or self.kv.block_ids(s):
                    raise RuntimeError(f"waiting seq {s.seq_id} still holds executor state or blocks")
        pins: dict[int, int] = {}
        for r in self.requests.values():
            if r.lora_slot is not None:
                if r.state is RequestState.WAITING:
                    raise RuntimeError(f"waiting request {r.request_id} pins LoRA slot {r.lora_slot}")
                pins[r.lora_slot] = pins.get(r.lora_slot, 0) + 1
                key = lora_key(r.req.lora, r.req.lora_id)
                if self.lora.held().get(r.lora_slot) != key:
                    raise RuntimeError(f"request {r.request_id} runs under slot {r.lora_slot}, which holds "
                                       f"{self.lora.held().get(r.lora_slot)!r}, not {key!r}")
        self.lora.check(pins)
        owed: dict[int, int] = {}  # placeholders each live sequence is owed by the plans in flight
        for step in self.in_flight:
            for s in step.sampling + step.beams:
                if s.finish_reason is None:
                    owed[s.seq_id] = owed.get(s.seq_id, 0) + step.decode_steps
        for s in self.seqs.values():
            if s.num_placeholders != owed.get(s.seq_id, 0):
                raise RuntimeError(f"seq {s.seq_id} holds {s.num_placeholders} placeholders; the plans in flight "
                                   f"owe it {owed.get(s.seq_id, 0)} samples")
