"""The whole serving path in one process, for the openai client's tests on a real (random-weight)
model: the engine, one executor thread running the tiny model with the grammar on its sampler,
and one HTTP front per chat template, all on a loop of their own.

A random model never chooses to end early or to call a tool by itself, so tests drive what a
grammar enforces (``tool_choice`` required or named, structured outputs) and compare routes
token for token (chat against /v1/responses).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import openai
from tokenizers import Tokenizer

from executor_svc.grammar import GrammarBackend
from executor_svc.worker import ExecutorWorker
from pagedserve import wire
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.front.http.app import OpenAIFront
from scheduler_svc.front.http.asgi_app import build_app
from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.serve import start_http_server
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.tool_calls import ToolCallOptions
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import make_runner
from testing.in_process_engine import Engine

SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}  # the tiny model's tokenizer's


class RealModelFront:
    """``templates``: each front's name -> (its chat template, its tool-call options)."""

    def __init__(self, model_dir: Path, templates: dict[str, tuple[str, ToolCallOptions]],
                 eos_token_ids: tuple[int, ...] = (0,), max_num_seqs: int = 8, num_blocks: int = 256) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024),
                           executor_endpoint="tcp://127.0.0.1:0", heartbeat_interval_s=0.5)
        self.engine = Engine(cfg, tok, eos_token_ids)
        self.call(self.engine.start())
        runner = make_runner(model_dir, num_blocks=num_blocks)
        runner.grammar = GrammarBackend.for_model(model_dir, runner.model.cfg.vocab_size)
        hs = wire.Handshake("real0", wire.WIRE_VERSION, "tiny", "tiny", "LlamaForCausalLM", runner.model.cfg.vocab_size,
                            16, num_blocks, 16, 4096, "float32", "cpu")
        self.worker = ExecutorWorker(f"tcp://127.0.0.1:{self.engine.hub.bound_port}", runner, hs, drain_timeout=1.0)
        threading.Thread(target=self.worker.run, daemon=True).start()
        self.call(self._ready())
        self.servers, self.urls = [], {}
        for name, (source, tool_options) in templates.items():
            front = OpenAIFront(self.engine, tok, ChatTemplate.compile(source, SPECIAL), ServerLimits(), HttpLimits(),
                                tool_options=tool_options)
            server = self.call(start_http_server(build_app(front), "127.0.0.1", 0))
            self.servers.append(server)
            self.urls[name] = f"http://127.0.0.1:{server.port}/v1"

    async def _ready(self) -> None:
        while not self.engine.is_ready():
            await asyncio.sleep(0.02)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[name], api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        for s in self.servers:
            self.call(s.stop(0.5))
        self.call(self.engine.shutdown(0))
        self.worker._signals = 2
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
