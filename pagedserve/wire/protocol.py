"""Protocol constants both services rely on; each exists here once.

Neither ``scheduler_svc`` nor ``executor_svc`` owns the wire between them: the
messages (:mod:`pagedserve.wire.messages`, :mod:`pagedserve.wire.link_messages`), their codec
(:mod:`pagedserve.wire.codec`) and these numbers live in the neutral
``pagedserve`` package that both import.
"""

from __future__ import annotations

# Frames are msgpack arrays [WIRE_VERSION, KIND, TAG, body]; any change of a message's
# fields, their order or meaning bumps this. A frame of another version is refused
# before its body is read, naming both versions. TAG is the step id of a plan or a
# result (0 for every other kind): a receiver checks it against what it sent before
# it parses the body.
WIRE_VERSION = 8  # 8: proposals for constrained sequences (verified under their grammars) and to tensor-parallel executors; 7: draft-model speculation (BatchPlan.draft_proposals, Handshake.draft_model); 6: LoRA loads and slots (BatchPlan.lora_loads, NewSeq.lora_slot), speculative proposals

# Message kinds (the second element of every frame).
KIND_HANDSHAKE = 1
KIND_HANDSHAKE_REPLY = 2
KIND_HEARTBEAT = 3
KIND_PLAN = 4
KIND_RESULT = 5
KIND_DRAIN = 6
KIND_RESET = 7

# ---- bounds on what a peer may send (decoding is the trust boundary) ------------
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a plan re-sending long prompts for many sequences
MAX_HANDSHAKE_FRAME_BYTES = 4096  # what a peer may send before it is registered
MAX_RESULT_FRAME_BYTES = 16 * 1024 * 1024  # what the scheduler accepts from an executor (libzmq enforces it)
MAX_SEQS_PER_STEP = 1 << 16  # sequences one plan or result may name
MAX_SEQ_TOKENS = 1 << 22  # tokens (and so blocks) of one sequence
MAX_BLOCK_PAIRS = 1 << 20  # swap and copy pairs of one plan
MAX_TOP_LOGPROBS = 1 << 10  # alternatives reported for one token (logprobs, beam candidates)
MAX_ID_CHARS = 256  # executor ids, model names, dtypes, devices
MAX_TEXT_CHARS = 4096  # error and refusal messages
MAX_REJECTION_CHARS = 1024  # a rejected sequence's reason, which its client is told
MAX_INT32 = 2**31 - 1  # sequence, token and block ids: the executor indexes with int32
MAX_SEED = 2**64 - 1  # a seed is 64 bits (sampler.seeded_uniform); choice i of n uses (seed + i) mod 2**64
MAX_TENSOR_PARALLEL_SIZE = 1024  # ranks (GPUs) of one executor
MAX_LOGIT_BIAS = 1 << 16  # (token id, bias) pairs of one sequence's logit bias
MAX_END_TOKEN_IDS = 1 << 12  # ids that end one sequence (its EOS ids and stop token ids)
MAX_STRUCTURED_CHARS = 1 << 20  # characters of one structured-output spec (a JSON schema, a grammar)
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 24  # prompt-log-prob alternatives one sequence reports in one result
MAX_LORA_SLOTS = 256  # LoRA adapters one executor computes in one step (Handshake.lora_slots)
MAX_LORA_PATH_CHARS = 4096  # an adapter directory as the executor sees it (LoraLoad.path)
MAX_SPECULATIVE_TOKENS = 16  # tokens proposed to one sequence in one step (BatchPlan.proposals)
MAX_DECODE_STEPS = 64  # decode steps one plan may ask for (BatchPlan.decode_steps)

# ---- what one request may ask for on the front link (a Submit's GenerationRequest) ---
# A front's limits (--max-n, ...) may not exceed these: a Submit past one does not decode, and the
# engine core drops the front that sent it. Within them, the core holds each request to its own
# limits (pagedserve/request_bounds.py), failing that request alone.
MAX_REQUEST_ID_CHARS = 512  # request ids (the front's prefix and the client's id) and front ids
MAX_CHOICES = 1 << 12  # n: choices of one request
MAX_STOP_STRINGS = 1 << 12  # stop strings of one request (distinct)
MAX_STOP_STRING_CHARS = 1 << 12  # characters of one stop string
# Beam scores divide by length ** length_penalty: within this bound that stays a finite float for
# any length up to MAX_SEQ_TOKENS (2**22 ** 10 ~ 1e66), and it is far beyond any useful value.
MAX_LENGTH_PENALTY = 10.0

# ---- KV cache layout both sides must agree on ------------------------------------
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block (the paper's default)
BLOCK_SIZES = (8, 16, 32)  # what the CUDA kernels are built for

# ---- liveness ---------------------------------------------------------------------
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0  # the scheduler's default; an executor uses it until told
DEAD_AFTER_INTERVALS = 5  # a peer silent this many heartbeat intervals is dead (both sides)

# ---- sampling -----------------------------------------------------------------------
# Temperatures below this are greedy: dividing logits by ~0 overflows. The API edge
# maps them to 0.0 and the executor's sampler treats them as greedy.
GREEDY_TEMPERATURE_EPS = 1e-5

# ---- structured outputs: SamplingParams.structured.kind (the spec's meaning) -----
STRUCTURED_JSON = 1  # spec: a JSON schema (JSON text); JSON_OBJECT_SCHEMA for any JSON object
STRUCTURED_REGEX = 2  # spec: a regular expression the whole output matches
STRUCTURED_CHOICE = 3  # spec: a JSON array of strings; the output is one of them
STRUCTURED_GRAMMAR = 4  # spec: an EBNF grammar in GBNF notation, rule "root" first
STRUCTURED_KINDS = (STRUCTURED_JSON, STRUCTURED_REGEX, STRUCTURED_CHOICE, STRUCTURED_GRAMMAR)
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # (json_object: whatever a front's --max-structured-chars)

# ---- step sizes ---------------------------------------------------------------------
# The scheduler's default --max-num-batched-tokens: the largest step an executor
# profiles when sizing its KV cache on a GPU.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# ---- grpc.health.v1 service names (the Kubernetes probes use these) --------------
HEALTH_LIVENESS = "liveness"  # both services: SERVING while the process runs
HEALTH_SCHEDULER_READY = "pagedserve.v1.Generation"  # SERVING once an executor registered
HEALTH_EXECUTOR_READY = "executor"  # SERVING once the scheduler accepted the handshake
