"""The leader's messages to its followers, over the group's control process group (gloo).

No pickle: a plan travels as the wire codec's own bytes (``pagedserve.wire.encode``) in a uint8
tensor, its length first; the followers decode it with the same typed, bounded decoder the
leader used on the scheduler's frame. Each message starts with an int64 header
``[kind, length]``:

- ``PLAN``: ``length`` bytes of an encoded ``BatchPlan`` follow;
- ``RESET``: forget every sequence (the leader reconnected to the scheduler);
- ``TICK``: nothing; sent when the leader has been idle for :data:`TICK_S`, so a follower
  waiting for the next plan never reaches the collective timeout;
- ``STOP``: the group is shutting down (drained, refused, or interrupted).

After a plan whose forward produced logits, the leader sends the step's sampled tokens as
int64 ``[TOKENS, status, token...]``: one per sampling row that is not a beam row, in batch
order, a length both sides know. Followers append them as the leader did; a row sent as
:data:`DROPPED` (-1, never a token id) failed alone on the leader (its grammar cannot be served):
its sequence is dropped on every rank. ``status`` is ``FAILED`` when sampling raised on the leader
(the step is then reported as failed and nothing is appended anywhere).

After those, a step that verified speculative proposals sends what each speculating sequence
emitted after its first token, as int64 ``[SPEC_TOKENS, n_1, t_1..., n_2, t_2..., ...]``: per
speculating sequence in batch order, its count and that many tokens padded with 0 to its number of
proposals (it emits at most that many beyond the first), a length both sides know from the plan.
"""

from __future__ import annotations

import torch

from executor_svc.parallel.group import TPGroup
from pagedserve import wire

PLAN, RESET, TICK, STOP, TOKENS, SPEC_TOKENS = 1, 2, 3, 4, 5, 6
OK, FAILED = 0, 1
DROPPED = -1  # a row's token when the leader dropped its sequence instead
TICK_S = 1.0
MAX_PLAN_BYTES = wire.MAX_FRAME_BYTES  # the plan came in one such frame: a header announcing more is corrupt


class PlanChannel:
    def __init__(self, group: TPGroup) -> None:
        self.group = group

    # ---------------------------------------------------------------- leader

    def send(self, kind: int, payload: bytes = b"") -> None:
        with self.group.fatal_on_error("sending to the followers"):
            self.group.broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64))
            if payload:
                self.group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def send_tokens(self, status: int, tokens: list[int], count: int) -> None:
        """``count`` token ids, or DROPPED (padded with 0 when the step failed)."""
        body = tokens if status == OK else [0] * count
        with self.group.fatal_on_error("sending sampled tokens"):
            if len(body) != count:  # the followers expect exactly count: a bug, and fatal
                raise RuntimeError(f"sampled {len(body)} tokens for {count} sampling rows")
            self.group.broadcast(torch.tensor([TOKENS, status, *body], dtype=torch.int64))

    def send_spec_tokens(self, emitted: list[list[int]], widths: list[int]) -> None:
        """Each speculating sequence's tokens after its first (``emitted[i]``, at most ``widths[i]``:
        its proposals)."""
        body: list[int] = []
        with self.group.fatal_on_error("sending speculative tokens"):
            for toks, width in zip(emitted, widths, strict=True):
                if len(toks) > width:  # the followers read exactly width: a bug, and fatal
                    raise RuntimeError(f"{len(toks)} speculative tokens from {width} proposals")
                body += [len(toks), *toks, *[0] * (width - len(toks))]
            self.group.broadcast(torch.tensor([SPEC_TOKENS, *body], dtype=torch.int64))

    # ---------------------------------------------------------------- followers

    def recv(self) -> tuple[int, bytes]:
        """The next (kind, payload) from the leader."""
        with self.group.fatal_on_error("waiting for the leader"):
            header = self.group.broadcast(torch.zeros(2, dtype=torch.int64)).tolist()
            kind, length = header
            if kind not in (PLAN, RESET, TICK, STOP) or not 0 <= length <= MAX_PLAN_BYTES:
                raise RuntimeError(f"corrupt control header {header}")
            if not length:
                return kind, b""
            return kind, self.group.broadcast(torch.empty(length, dtype=torch.uint8)).numpy().tobytes()

    def recv_tokens(self, count: int) -> list[int] | None:
        """The step's sampled tokens (DROPPED for a row whose sequence the leader dropped), or None
        when sampling failed on the leader."""
        with self.group.fatal_on_error("waiting for sampled tokens"):
            msg = self.group.broadcast(torch.zeros(2 + count, dtype=torch.int64)).tolist()
            if msg[0] != TOKENS or msg[1] not in (OK, FAILED):
                raise RuntimeError(f"expected sampled tokens, got header {msg[:2]}")
            if msg[1] == OK and count and min(msg[2:]) < DROPPED:
                raise RuntimeError(f"corrupt sampled token {min(msg[2:])}")
        return msg[2:] if msg[1] == OK else None

    def recv_spec_tokens(self, widths: list[int]) -> list[list[int]]:
        """What :meth:`send_spec_tokens` sent for sequences of ``widths`` proposals."""
        with self.group.fatal_on_error("waiting for speculative tokens"):
            msg = self.group.broadcast(torch.zeros(1 + sum(1 + w for w in widths), dtype=torch.int64)).tolist()
            if msg[0] != SPEC_TOKENS:
                raise RuntimeError(f"expected speculative tokens, got header {msg[0]}")
            out, at = [], 1
            for width in widths:
                n = msg[at]
                if not 0 <= n <= width or min(msg[at + 1:at + 1 + n], default=0) < 0:
                    raise RuntimeError(f"corrupt speculative tokens {msg[at:at + 1 + width]}")
                out.append(msg[at + 1:at + 1 + n])
                at += 1 + width
        return out
