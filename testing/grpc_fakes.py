"""Test helpers for the gRPC layer: a tiny trained tokenizer, a fake engine, a server thread.

The fake engine implements the engine interface of docs/ARCHITECTURE.md
("Engine <-> servicer") and records what the servicer did to it, so tests can
check deadlines, cancellation (the generator is closed) and error mapping.
"""

from __future__ import annotations

import asyncio
import functools
import threading

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedserve.engine_api import (
    ChoiceDelta,
    EngineError,
    EngineStats,
    ErrorKind,
    ExecutorStats,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from scheduler_svc.front.grpc.server import ApiServer, start_grpc_server
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.output.detokenize import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello again!",
    "Grüße aus München: naïve café, crème brûlée, smörgåsbord and façade.",
    "日本語のテキストも少し。 Emoji too: 🙂🚀 and ünïcödé everywhere.",
    "Stop words like END and STOP appear here; the end is near. The end.",
]
BOS, EOS = "<s>", "</s>"


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on CORPUS: <s>=0, </s>=1, vocab 300, BOS added to prompts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def model_info(tok: Tokenizer, max_model_len: int = 64) -> ModelInfo:
    return ModelInfo(model_name="tiny-test", architecture="LlamaForCausalLM", max_model_len=max_model_len,
                     vocab_size=tok.get_vocab_size(), block_size=16, num_executors=1, eos_token_ids=(1,))


class FakeEngine:
    """Streams ``completions[i % len]`` for choice i, token by token, via the real detokenizer.

    ``mode`` picks a behaviour: "ok", "queue_full", "no_executor" (raised before
    the first output), "fail" (a FAILED EngineError after one output), "crash"
    (ZeroDivisionError after one output), "bad_logprobs" (top ids and
    top logprobs of different lengths), "endless" (1 KB deltas forever, never
    awaiting: a cancel can then only land in the servicer's write).
    """

    def __init__(self, tok: Tokenizer, max_model_len: int = 64) -> None:
        self.tok = tok
        self.info: ModelInfo | None = model_info(tok, max_model_len)
        self.ready = False
        self.engine_stats = EngineStats()
        self.reset()

    def reset(self) -> None:
        self.mode = "ok"
        self.completions = ["Hello world, the end."]
        self.token_delay = 0.0
        self.spec_usage = (0, 0)  # the final usage's speculative decoding totals (proposed, accepted)
        self.requests: list[GenerationRequest] = []
        self.closed: list[tuple[str, bool]] = []  # (request_id, finished normally)
        self.closed_event = threading.Event()

    def model_info(self) -> ModelInfo | None:
        return self.info

    async def current_stats(self):
        return self.stats()

    def health_problem(self) -> str | None:
        return None

    def is_ready(self) -> bool:
        return self.ready

    def stats(self) -> EngineStats:
        return self.engine_stats

    async def generate(self, req: GenerationRequest):
        self.requests.append(req)
        done = False
        try:
            if self.mode == "queue_full":
                raise EngineError(ErrorKind.QUEUE_FULL, "1024 requests queued")
            if self.mode == "no_executor":
                raise EngineError(ErrorKind.NO_EXECUTOR, "all executors left")
            while self.mode == "endless":
                yield RequestOutput(req.request_id, [ChoiceDelta(index=0, text="x" * 1024, token_ids=[5])])
            async for out in self._stream(req):
                yield out
                if self.mode == "fail":
                    raise EngineError(ErrorKind.FAILED, "executor returned garbage")
                if self.mode == "crash":
                    raise ZeroDivisionError("bug")
            done = True
        finally:
            self.closed.append((req.request_id, done))
            self.closed_event.set()

    async def _stream(self, req: GenerationRequest):
        p = req.params
        seqs = [self.tok.encode(self.completions[i % len(self.completions)], add_special_tokens=False).ids
                + [1] for i in range(p.n)]
        detoks = [IncrementalDetokenizer(self.tok, req.prompt_token_ids, p.stop) for _ in range(p.n)]
        produced = [0] * p.n
        running = set(range(p.n))
        while running:
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            deltas = [self._advance(i, seqs[i], detoks[i], produced, running, p) for i in sorted(running)]
            usage = None
            if not running:
                usage = Usage(len(req.prompt_token_ids), sum(produced), cached_prompt_tokens=3,
                              spec_proposed_tokens=self.spec_usage[0], spec_accepted_tokens=self.spec_usage[1])
            out = RequestOutput(req.request_id, deltas, usage=usage, finished=usage is not None)
            if p.sampling.prompt_logprobs >= 0 and sum(produced) == len(deltas):  # the first output
                k = p.sampling.prompt_logprobs
                out.prompt_logprobs = [None] + [TokenLogprob(t, -1.0 - j / 10, list(range(2, 2 + k)), [-0.5] * k, k + 1 + j)
                                                for j, t in enumerate(req.prompt_token_ids[1:])]
            yield out

    def _advance(self, i, seq, detok, produced, running, p) -> ChoiceDelta:
        tid = seq[produced[i]]
        produced[i] += 1
        delta = ChoiceDelta(index=i, token_ids=[tid])
        if p.sampling.want_logprobs:
            k = p.sampling.logprobs + (1 if self.mode == "bad_logprobs" else 0)
            delta.logprobs = [TokenLogprob(tid, -0.5, list(range(k)), [-1.0] * p.sampling.logprobs)]
        if self.mode == "aborted" and produced[i] == 2:  # the server shut down past its grace period
            delta.text, delta.finish_reason = detok.finish(), FinishReason.ABORTED
        elif tid == 1:
            delta.text, delta.finish_reason = detok.finish(), FinishReason.EOS
        else:
            delta.text = detok.step(tid)
            if detok.stop_matched is not None:
                delta.finish_reason, delta.stop_reason = FinishReason.STOP, detok.stop_matched
            elif produced[i] == p.max_tokens:
                delta.text += detok.finish()
                delta.finish_reason = FinishReason.LENGTH
        if delta.finish_reason != FinishReason.UNSPECIFIED:
            running.discard(i)
        return delta


def example_stats() -> EngineStats:
    return EngineStats(
        num_running=3, num_waiting=2, num_swapped=1, num_preemptions=7, prefix_cache_query_tokens=1000,
        prefix_cache_hit_tokens=640, num_migrations=2,
        executors=[
            ExecutorStats("gpu-0", "ready", 1000, 400, 100, 30, 200, 10, num_running=2, num_waiting=1),
            ExecutorStats("gpu-1", "draining", 500, 50, 5, 0, 100, 0, num_running=1, num_waiting=1,
                          tensor_parallel_size=4),
        ],
    )


class ServerThread:
    """A grpc.aio server with a fake engine, on its own event loop thread."""

    def __init__(self, engine: FakeEngine, limits: ServerLimits | None = None, metrics=None, **server) -> None:
        """``server``: more of start_grpc_server's arguments (grpc_limits, api_keys, tls, budget)."""
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.api: ApiServer = self.call(start_grpc_server(
            engine, engine.tok, host="127.0.0.1", port=0, limits=limits, metrics=metrics,
            health_poll_interval=None, **server))
        self.address = f"127.0.0.1:{self.api.port}"

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.api.shutdown(0.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
