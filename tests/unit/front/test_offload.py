"""Tokenizing a long prompt in a worker thread must leave the front's event loop free to run."""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenizers import Tokenizer

from scheduler_svc.front.input.offload import token_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


@pytest.mark.parametrize("special", [True, False])
def test_token_ids_are_encodes(tokenizer, special):
    for text in ("", "hello", "The quick brown fox jumps over the lazy dog. " * 50, "ünïcode ✓ 日本語"):
        assert token_ids(tokenizer, text, special) == tokenizer.encode(text, add_special_tokens=special).ids


def _longest_pause_while(fn) -> tuple[float, float]:
    """(the longest wait of an event loop's 1 ms sleeps while ``fn`` runs in a worker thread, fn's time)."""

    async def run() -> tuple[float, float]:
        done = asyncio.Event()

        async def probe() -> float:
            worst = 0.0
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                worst = max(worst, time.perf_counter() - t)
            return worst

        watching = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        t = time.perf_counter()
        await asyncio.to_thread(fn)
        spent = time.perf_counter() - t
        done.set()
        return await watching, spent

    return asyncio.run(run())


def test_the_gil_is_released_while_a_long_prompt_is_tokenized(tokenizer):
    """Under ``Tokenizer.encode`` in a worker thread the event loop stops for nearly all of it (it
    holds the GIL); under ``token_ids`` it must not."""
    text = "The quick brown fox jumps over the lazy dog. " * 8000
    held, spent = _longest_pause_while(lambda: tokenizer.encode(text).ids)
    assert held > 0.5 * spent  # the reference: encode does stop it
    released, spent = _longest_pause_while(lambda: token_ids(tokenizer, text, True))
    assert released < 0.5 * spent
