"""The wire contract: every message round-trips, and every malformed frame is a WireError."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import wire
from pagedserve.wire import (
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
    pack_ids,
)

ids = st.integers(min_value=0, max_value=2**31 - 1)
small = st.lists(ids, max_size=8)
pairs = st.lists(st.tuples(ids, ids), max_size=6)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
unit = st.floats(min_value=0.0, max_value=1.0)
positive = st.floats(min_value=1e-6, max_value=1e6)
# In-range values: the declared bounds are checked when decoding.
sampling = st.builds(SamplingParams, positive, st.floats(min_value=1e-6, max_value=1.0), ids, unit,
                     st.none() | ids, positive, floats, floats, st.booleans(), st.integers(0, 1024),
                     st.integers(0, 1024))
new_seqs = st.builds(NewSeq, ids, small.map(pack_ids), ids, small, ids, sampling)
scheduled = st.lists(st.tuples(ids, ids), max_size=8)
plans = st.builds(
    lambda step, sched, *rest: BatchPlan(step, [s for s, _ in sched], [n for _, n in sched], *rest),
    ids, scheduled, st.lists(new_seqs, max_size=3), small,
    st.lists(st.builds(Fork, ids, ids, st.none() | ids), max_size=3), pairs,
    st.lists(st.builds(BlockUpdate, ids, ids, small), max_size=3), pairs, pairs, pairs)
top = st.lists(st.tuples(ids, floats), max_size=8)
logprobs = st.builds(lambda sid, lp, t: SeqLogprobs(sid, lp, [i for i, _ in t], [v for _, v in t]), ids, floats, top)
results = st.builds(lambda step, lps, beams, failed, refused, error, secs: StepResult(
    step, [1, 2], [3, 4], lps, beams, failed, refused, error, secs),
    ids, st.lists(logprobs, max_size=3), st.lists(logprobs, max_size=3), small, st.booleans(),
    st.none() | st.text(max_size=20), st.floats(min_value=0.0, max_value=1e9))


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


def test_handshake_tensor_parallel_size_is_optional_and_bounded():
    fields = ["ex-1", wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 100, 20, 4096, "float32", "cpu"]
    assert wire.decode(_frame(fields, wire.KIND_HANDSHAKE)).tensor_parallel_size == 1  # an older executor
    assert wire.decode(wire.encode(Handshake(*fields, tensor_parallel_size=8))).tensor_parallel_size == 8
    for bad in (0, 1025):
        with pytest.raises(WireError, match="handshake.tensor_parallel_size"):
            wire.decode(_frame([*fields, bad], wire.KIND_HANDSHAKE))


def test_a_decode_step_costs_a_few_bytes_per_sequence():
    plan = BatchPlan(7, list(range(1000, 1256)), [1] * 256)
    assert len(wire.encode(plan)) / 256 < 5


def _frame(body, kind=wire.KIND_PLAN, version=wire.WIRE_VERSION, tag=None) -> bytes:
    if tag is None:  # a plan's or result's tag is its step id
        tag = body[0] if kind in (wire.KIND_PLAN, wire.KIND_RESULT) and body and isinstance(body[0], int) else 0
    return msgpack.packb([version, kind, tag, body])


GOOD_PLAN = msgpack.unpackb(wire.encode(BatchPlan(1, [1], [1])))[3]
GOOD_SEQ = [1, b"\x02\x00\x00\x00", 1, [4], 0, [1.0, 1.0, 0, 0.0, None, 1.0, 0.0, 0.0, False, 0, 0]]


@pytest.mark.parametrize("frame,needle", [
    (b"", "not a frame"),
    (b"\xc1", "not a frame"),
    (wire.encode(BatchPlan(1, [1], [1]))[:-1], "truncated"),
    (msgpack.packb({"a": 1}), "not a frame"),
    (msgpack.packb("a frame"), "not a frame"),
    (msgpack.packb([wire.WIRE_VERSION, 2]), "not a frame"),
    (msgpack.packb([2, 4, GOOD_PLAN]), "wire version 2, expected"),  # the envelope of version 2
    (_frame(GOOD_PLAN, version=99), "wire version 99"),
    (_frame(GOOD_PLAN, tag=2), "a BatchPlan of step 1 in a frame tagged 2"),
    (_frame([1.5], kind=wire.KIND_HEARTBEAT, tag=3), "a Heartbeat frame with tag 3"),
    (bytes([0x94, wire.WIRE_VERSION, 4, 1]) + b"\x91" * 5000 + b"\xc0", "RecursionError"),  # nested 5,000 deep in the body
    (bytes([0x94, wire.WIRE_VERSION, 4, 1]) + b"\x9b\x01\x90\x90" + b"\x91" * 5000 + b"\xc0", "RecursionError"),
    (b"\x93\x02\x01" + b"\x91" * 1000, "not a frame"),  # the review's 1,003-byte frame
    (_frame(GOOD_PLAN, kind=42), "unknown message kind 42"),
    (_frame(GOOD_PLAN + [[], []]), "at most length 15"),
    (_frame(GOOD_PLAN[:14] + [[[1, 17]]]), r"plan\.draft_proposals\[0\]"),  # more than 16 draft tokens
    (_frame(GOOD_PLAN[:14] + [[[1, 0]]]), r"plan\.draft_proposals\[0\]"),
    (_frame([1, [1, "x"], [1, 1]] + GOOD_PLAN[3:]), r"plan\.scheduled_seq_ids\[1\]"),
    (_frame([1, [1, 2], [1]] + GOOD_PLAN[3:]), "differ in length"),
    (_frame(GOOD_PLAN[:6] + [[[1, 2, 3]]] + GOOD_PLAN[7:]), r"plan\.append_tokens\[0\]"),
    (_frame([1.5] + GOOD_PLAN[1:]), r"plan\.step_id"),
    (_frame([1, [], [], [GOOD_SEQ[:5] + [["hot"]]]] + GOOD_PLAN[4:]), r"plan\.new_seqs\[0\]\.sampling\.temperature"),
    (_frame([1, [], [], [[1, [2, 3]] + GOOD_SEQ[2:]]] + GOOD_PLAN[4:]),
     r"Expected `bytes`, got `array` \(at plan\.new_seqs\[0\]\.token_ids\)"),  # (packed since wire version 4)
    (_frame([1, [], [], [GOOD_SEQ[:5] + [[float("nan")] + GOOD_SEQ[5][1:]]]] + GOOD_PLAN[4:]),
     r"new_seqs\[0\]\.sampling\.temperature"),
    (_frame([1, [], [], [], [], [], [], [], [], [], [[1, 2**40]]]), r"plan\.copies\[0\]\[1\]"),
    (_frame(["ex", 1], kind=wire.KIND_HANDSHAKE), "handshake"),
])
def test_malformed_frames_are_wire_errors_naming_what_is_wrong(frame, needle):
    with pytest.raises(WireError, match=needle):
        wire.decode(frame)


def test_the_good_building_blocks_of_those_frames_decode():
    assert wire.decode(_frame(GOOD_PLAN)) == BatchPlan(1, [1], [1])
    plan = wire.decode(_frame([1, [], [], [GOOD_SEQ]] + GOOD_PLAN[4:]))
    assert plan.new_seqs == [NewSeq(1, pack_ids([2]), 1, [4], 0, SamplingParams())]


def test_oversized_frame_is_refused_before_parsing():
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode(b"\x00" * (wire.MAX_FRAME_BYTES + 1))


def test_a_kind_not_accepted_is_refused_before_its_body_is_parsed():
    body = msgpack.packb([wire.WIRE_VERSION, wire.KIND_PLAN, 0, [[[]] * 1000] * 1000])  # nonsense, never parsed
    with pytest.raises(WireError, match="BatchPlan is not accepted here"):
        wire.decode(body, accept=(Handshake,))


def test_bounds_are_checked_while_decoding_not_on_construction():
    huge = BatchPlan(1, new_seqs=[NewSeq(1, pack_ids([7] * (wire.MAX_SEQ_TOKENS + 1)), 1, [0], 0, SamplingParams())])
    with pytest.raises(WireError, match=r"new_seqs\[0\]\.token_ids"):
        wire.decode(wire.encode(huge))


def test_with_seed_keeps_every_other_field():
    sp = SamplingParams(0.5, 0.9, 7, 0.1, 3, 1.2, 0.3, 0.4, True, 5, 0)
    child = sp.with_seed(11)
    assert child.seed == 11 and sp.seed == 3
    assert msgspec.structs.replace(child, seed=3) == sp


# ---------------------------------------------------------------- the envelope, before the body

def test_the_envelope_is_read_without_parsing_the_body():
    frame = _frame(["not", "a", "result"], kind=wire.KIND_RESULT, tag=42)
    env = wire.read_envelope(frame, accept=(StepResult,))
    assert (env.kind, env.tag, env.size) == (StepResult, 42, len(frame))
    with pytest.raises(WireError, match="malformed StepResult"):
        wire.decode_body(env)


def test_a_result_larger_than_its_plan_allows_is_never_larger_than_the_bound():
    """max_result_bytes is an upper bound on what an honest executor sends for a plan."""
    text = "\U0001F600" * wire.MAX_TEXT_CHARS  # 4 bytes a character in UTF-8
    big = 2**31 - 1
    lp = SeqLogprobs(big, -1e300, [big] * 21, [-1e300] * 21)
    result = StepResult(big, [big] * 256, [big] * 256, [lp] * 256, [SeqLogprobs(big, 0.0, [big] * 8, [-1.5] * 8)] * 4,
                        [big] * 300, True, text, 1e300)
    bound = wire.max_result_bytes(num_scheduled=300, num_sampled=256, logprobs=256 * 20, num_logprob_seqs=256,
                                  beam_candidates=4 * 8, num_beam_seqs=4)
    assert len(wire.encode(result)) <= bound < 1.2 * len(wire.encode(result))


def test_rejections_fit_the_bound_of_the_constrained_sequences_and_name_failed_ones_only():
    reason = "\U0001F600" * wire.MAX_REJECTION_CHARS
    ids = [2**31 - 1 - i for i in range(256)]
    result = StepResult(1, failed_seq_ids=ids, error="x" * wire.MAX_TEXT_CHARS,
                        rejected=[wire.SeqRejection(i, reason) for i in ids])
    bound = wire.max_result_bytes(num_scheduled=256, num_sampled=256, num_constrained=256)
    assert len(wire.encode(result)) <= bound
    assert bound - wire.max_result_bytes(num_scheduled=256, num_sampled=256) < 1.1 * 256 * 4 * wire.MAX_REJECTION_CHARS
    lying = StepResult(1, failed_seq_ids=[1, 2], rejected=[wire.SeqRejection(2, "r")])
    lying.failed_seq_ids = [1]  # (construction checks it too)
    with pytest.raises(WireError, match="rejected names sequences that are not in failed_seq_ids"):
        wire.decode(wire.encode(lying))
    with pytest.raises(WireError, match=r"rejected\[0\]\.reason"):
        wire.decode(wire.encode(StepResult(1, failed_seq_ids=[1], rejected=[wire.SeqRejection(1, "r" * 1025)])))


def test_a_plain_decode_step_result_is_bounded_tightly():
    bound = wire.max_result_bytes(num_scheduled=256, num_sampled=256)
    assert bound < 16 * 1024 + 256 * 20  # the error text's room, and ~20 bytes a sequence


# ---------------------------------------------------------------- fuzzing the codec

VALID_FRAMES = [wire.encode(m) for m in (
    BatchPlan(3, [1, 2], [4, 1], new_seqs=[NewSeq(1, pack_ids([5, 6, 7, 8]), 4, [0], 0, SamplingParams(seed=3))],
              forks=[Fork(1, 9, 4)], block_updates=[BlockUpdate(2, 1, [7])], copies=[(1, 2)]),
    StepResult(3, [1], [9], [SeqLogprobs(1, -0.5, [9, 4], [-0.5, -2.0])], failed_seq_ids=[2], error="x"),
    Handshake("ex-1", wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 100, 20, 4096,
              "float32", "cpu"),
    HandshakeReply(True, "", 1.0), Heartbeat(1.0), Drain(3.0), wire.Reset("plan 3 was refused"),
)]
NESTED = [b"\x91" * 3000 + b"\xc0", b"\x81\xa1k" * 2000 + b"\xc0", b"\xdd\xff\xff\xff\xff",
          b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"]


def _decode_or_refuse(frame: bytes) -> None:
    """Decoding a frame either gives a message or raises WireError: nothing else, whatever it holds."""
    try:
        wire.decode(frame)
    except WireError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_only_ever_raise_wire_errors(frame):
    _decode_or_refuse(frame)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(VALID_FRAMES), st.data())
def test_mutated_truncated_and_nested_frames_only_ever_raise_wire_errors(frame, data):
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "nest", "length"]))
    at = data.draw(st.integers(0, len(frame)))
    if op == "flip":
        frame = frame[:at] + bytes([data.draw(st.integers(0, 255))]) + frame[at + 1:]
    elif op == "truncate":
        frame = frame[:at]
    elif op == "insert":
        frame = frame[:at] + data.draw(st.binary(min_size=1, max_size=16)) + frame[at:]
    elif op == "nest":  # a deep or huge container spliced in anywhere, the body included
        frame = frame[:at] + data.draw(st.sampled_from(NESTED)) + frame[at:]
    else:  # a container or string header claiming 4 GB
        frame = frame[:at] + bytes([data.draw(st.sampled_from([0xdc, 0xdd, 0xde, 0xdf, 0xdb, 0xc6]))]) + \
            b"\xff\xff\xff\xff" + frame[at:]
    _decode_or_refuse(frame)
