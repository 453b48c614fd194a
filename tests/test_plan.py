"""The wire contract: every message round-trips, and every malformed frame is a WireError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc import plan as wire
from scheduler_svc.plan import (
    BatchPlan,
    BlockUpdate,
    Drain,
    Fork,
    Handshake,
    HandshakeReply,
    Heartbeat,
    NewSeq,
    SamplingParams,
    SeqLogprobs,
    StepResult,
    WireError,
)

ids = st.integers(min_value=0, max_value=2**31 - 1)
small = st.lists(ids, max_size=8)
pairs = st.lists(st.tuples(ids, ids), max_size=6)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
sampling = st.builds(SamplingParams, floats, floats, ids, floats, st.none() | ids, floats, floats, floats,
                     st.booleans(), ids, ids)
new_seqs = st.builds(NewSeq, ids, small, ids, small, ids, sampling)
plans = st.builds(
    BatchPlan, ids, small, small, st.lists(new_seqs, max_size=3), small,
    st.lists(st.builds(Fork, ids, ids, st.none() | ids), max_size=3), pairs,
    st.lists(st.builds(BlockUpdate, ids, ids, small), max_size=3), pairs, pairs, pairs,
).filter(lambda p: len(p.scheduled_seq_ids) == len(p.num_new_tokens))
logprobs = st.builds(SeqLogprobs, ids, floats, small, st.lists(floats, max_size=8))
results = st.builds(StepResult, ids, st.just([1, 2]), st.just([3, 4]), st.lists(logprobs, max_size=3),
                    st.lists(logprobs, max_size=3), st.none() | st.text(max_size=20), floats)


@settings(max_examples=60, deadline=None)
@given(st.one_of(plans, results))
def test_plans_and_results_round_trip(msg):
    assert wire.decode(wire.encode(msg)) == msg


def test_control_messages_round_trip():
    msgs = [Handshake("ex-1", wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 100, 20,
                      4096, "float32", "cpu"),
            HandshakeReply(False, "block size 8, scheduler uses 16", 0.5), Heartbeat(1.5e9), Drain(30.0)]
    for msg in msgs:
        assert wire.decode(wire.encode(msg)) == msg


def test_a_decode_step_costs_a_few_bytes_per_sequence():
    plan = BatchPlan(7, list(range(1000, 1256)), [1] * 256)
    assert len(wire.encode(plan)) / 256 < 5


def _frame(body, kind=wire.KIND_PLAN, version=wire.WIRE_VERSION) -> bytes:
    return msgpack.packb([version, kind, body])


GOOD_PLAN = BatchPlan(1, [1], [1]).to_wire()


@pytest.mark.parametrize("frame,needle", [
    (b"", "not a msgpack frame"),
    (b"\xc1", "not a msgpack frame"),
    (wire.encode(BatchPlan(1, [1], [1]))[:-1], "not a msgpack frame"),
    (msgpack.packb({"a": 1}), "max_map_len"),
    (msgpack.packb("a frame"), "expected list"),
    (msgpack.packb([1, 2]), "expected 3 elements"),
    (_frame(GOOD_PLAN, version=99), "wire version 99"),
    (_frame(GOOD_PLAN, kind=42), "unknown message kind 42"),
    (_frame(GOOD_PLAN[:5]), "expected 11 elements"),
    (_frame([1, [1, "x"], [1, 1]] + GOOD_PLAN[3:]), "scheduled_seq_ids"),
    (_frame([1, [1, 2], [1]] + GOOD_PLAN[3:]), "differ in length"),
    (_frame(GOOD_PLAN[:6] + [[1, 2, 3]] + GOOD_PLAN[7:]), "even-length"),
    (_frame([1.5] + GOOD_PLAN[1:]), "step_id"),
    (_frame([1, [], [], [[1, [2], 3, [4], 0, [1.0]]]] + GOOD_PLAN[4:]), "sampling"),
    (_frame(["ex", 1], kind=wire.KIND_HANDSHAKE), "handshake"),
])
def test_malformed_frames_are_wire_errors_naming_what_is_wrong(frame, needle):
    with pytest.raises(WireError, match=needle):
        wire.decode(frame)


def test_oversized_frame_is_refused_before_parsing():
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode(b"\x00" * (wire.MAX_FRAME_BYTES + 1))
