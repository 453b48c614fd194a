"""Incremental detokenization and stop strings, on a byte-level BPE trained here."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scheduler_svc.front.output import detokenize
from scheduler_svc.front.output.detokenize import (
    IncrementalDetokenizer,
    StopStringBuffer,
    standalone_token_texts,
)
from testing.grpc_fakes import make_tokenizer

EOS_ID = 1


def run(text: str, stop=(), prompt: str = "Hi", tok: Tokenizer | None = None):
    """Feed ``text``'s tokens one by one; return (deltas, detokenizer, token ids)."""
    tok = tok or make_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok, tok.encode(prompt).ids, stop)
    deltas = []
    for tid in ids:
        deltas.append(d.step(tid))
        if d.finished:
            break
    deltas.append(d.finish())
    return deltas, d, ids


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: naïve café, crème brûlée.",
    "日本語のテキストも少し。 Emoji too: 🙂🚀 and ünïcödé everywhere.",
    "zzz qqq 💡 unseen ✓ bytes",  # characters outside the training text: raw byte tokens
])
def test_deltas_concatenate_to_the_text(text):
    deltas, d, _ = run(text)
    assert "".join(deltas) == text
    assert d.stop_matched is None and d.finished


def test_multibyte_character_split_across_tokens_is_emitted_whole():
    tok = make_tokenizer()
    text = "ok 💡 ok"  # not in the corpus: 4 UTF-8 bytes, several byte-level tokens
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(tok.decode([i]) == "\ufffd" for i in ids), "precondition: the emoji is split across tokens"
    deltas, _, _ = run(text)
    assert "" in deltas[:-1]  # held while the character is incomplete
    assert all("\ufffd" not in x for x in deltas)
    assert any("💡" in x for x in deltas)


def test_stop_string_split_across_tokens():
    tok = make_tokenizer()
    text, stop = "Hello world, the end.", "o w"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert all(stop not in tok.decode([i]) for i in ids), "precondition: the stop spans tokens"
    deltas, d, _ = run(text, [stop])
    assert "".join(deltas) == "Hell"
    assert d.stop_matched == stop and d.finished


def test_possible_stop_prefix_is_held_until_disambiguated():
    tok = make_tokenizer()
    text = "Stop words like END and STOP"
    ids = tok.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok, [0], ["ENDX"])
    emitted, decoded = "", ""
    for k, tid in enumerate(ids):
        emitted += d.step(tid)
        decoded = tok.decode(ids[: k + 1])
        assert decoded.startswith(emitted)
        held = decoded[len(emitted):]
        assert "ENDX".startswith(held)  # only a possible start of the stop is ever held
        if decoded.endswith("END"):
            assert emitted == "Stop words like "
    assert emitted + d.finish() == text and d.stop_matched is None


def test_stop_string_with_multibyte_characters():
    deltas, d, _ = run("Emoji too: 🙂🚀 and more", ["🙂🚀"])
    assert "".join(deltas) == "Emoji too: " and d.stop_matched == "🙂🚀"


def test_earliest_stop_wins():
    deltas, d, _ = run("The quick brown fox jumps over the lazy dog.", ["lazy", "quick", "fox"])
    assert "".join(deltas) == "The " and d.stop_matched == "quick"


def test_finish_releases_held_text():
    deltas, d, _ = run("Hello wor", ["world!"])
    assert deltas[-1].endswith("wor") and "wor" not in "".join(deltas[:-1])
    assert "".join(deltas) == "Hello wor" and d.stop_matched is None


def test_finish_with_incomplete_character_matches_full_decode():
    tok = make_tokenizer()
    ids = tok.encode("ok 💡", add_special_tokens=False).ids[:-1]  # cut inside the emoji
    d = IncrementalDetokenizer(tok, [0])
    text = "".join(d.step(i) for i in ids) + d.finish()
    assert text == tok.decode(ids) and text.endswith("\ufffd")


@pytest.mark.parametrize("skip,expected", [(True, "Hello"), (False, "Hello</s>")])
def test_eos_and_skip_special_tokens(skip, expected):
    tok = make_tokenizer()
    d = IncrementalDetokenizer(tok, [0], skip_special_tokens=skip)
    ids = tok.encode("Hello", add_special_tokens=False).ids + [EOS_ID]
    assert "".join(d.step(i) for i in ids) + d.finish() == expected


def test_prompt_context_keeps_the_leading_space():
    """SentencePiece-style decoders drop a leading space unless the prompt gives context."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(["Hello world, hello again. The world is big."] * 4,
                            trainers.BpeTrainer(vocab_size=120, show_progress=False))
    prompt = tok.encode("Hello").ids
    out = tok.encode("Hello world").ids[len(prompt):]
    d = IncrementalDetokenizer(tok, prompt)
    assert "".join(d.step(i) for i in out) + d.finish() == " world"


def test_fork_is_independent():
    tok = make_tokenizer()
    a = IncrementalDetokenizer(tok, [0], ["end"])
    head = "".join(a.step(i) for i in tok.encode("Hello ", add_special_tokens=False).ids)
    b = a.fork()
    ta = head + "".join(a.step(i) for i in tok.encode("world", add_special_tokens=False).ids) + a.finish()
    tb = head + "".join(b.step(i) for i in tok.encode("the end", add_special_tokens=False).ids) + b.finish()
    assert (ta, a.stop_matched, tb, b.stop_matched) == ("Hello world", None, "Hello the ", "end")


def test_step_after_stop_is_a_bug():
    _, d, ids = run("Hello world", ["Hello"])
    assert d.stop_matched == "Hello"
    with pytest.raises(RuntimeError):
        d.step(ids[-1])
    assert d.finish() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringBuffer(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_stop_buffer_matches_a_search_after_each_chunk(text, stops, cuts):
    """Reference: after the first chunk whose text contains a stop, cut at the earliest-starting stop."""
    chunks, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        chunks.append(text[prev:c])
        prev = max(prev, c)
    buf, emitted, fed = StopStringBuffer(stops), "", ""
    for chunk in chunks:
        emitted += buf.push(chunk)
        fed += chunk
        assert fed.startswith(emitted)
        found = [(fed.find(s), s) for s in stops if s in fed]
        if found:
            first = min(i for i, _ in found)
            assert emitted == fed[:first] and buf.matched in {s for i, s in found if i == first}
            return
        # No match yet: what is held is exactly the longest suffix that could start a stop.
        held = fed[len(emitted):]
        assert not held or any(s.startswith(held) and s != held for s in stops)
        assert all(not s.startswith(fed[i:]) for s in stops for i in range(len(emitted)))
    assert buf.matched is None and emitted + buf.flush() == text


# ---------------------------------------------------------------- the table of standalone token texts

SP_CORPUS = ["Hello world, hello again. The world is big.", "Grüße aus München, naïve café."]


def metaspace_tokenizer(byte_fallback: bool) -> Tokenizer:
    """SentencePiece-like: Metaspace pieces; with ``byte_fallback`` the Llama-2 decoder chain and
    <0x00>..<0xFF> pieces, so characters outside the corpus split into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(SP_CORPUS * 4, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"],
                                                               show_progress=False))
    if not byte_fallback:
        tok.decoder = decoders.Metaspace()
        return tok
    vocab = tok.get_vocab(with_added_tokens=False)
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab) + 2)
    merges = [tuple(m.split(" ") if isinstance(m, str) else m) for m in json.loads(tok.to_str())["model"]["merges"]]
    out = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    out.add_special_tokens(["<unk>", "</s>"])
    out.pre_tokenizer = pre_tokenizers.Metaspace()
    out.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return out


TOKENIZERS = {"byte-level": make_tokenizer, "metaspace": lambda: metaspace_tokenizer(False),
              "byte-fallback": lambda: metaspace_tokenizer(True)}


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_table_covers_plain_tokens_only(name):
    tok = TOKENIZERS[name]()
    table = standalone_token_texts(tok)
    vocab = tok.get_vocab()
    byte_ids = {i for t, i in vocab.items() if t.startswith("<0x")}
    # Most of a real vocabulary; here every token but the added ones and, in byte-level BPE,
    # the 128 lone bytes of multi-byte characters.
    assert len(table.texts) > (len(vocab) - len(byte_ids)) // 2
    assert not set(table.texts) & set(tok.get_added_tokens_decoder())  # special tokens: never looked up
    assert all(t and "\ufffd" not in t for t in table.texts.values())
    assert table.joining == (frozenset(byte_ids) if name == "byte-fallback" else frozenset())
    assert not set(table.texts) & byte_ids
    ids = tok.encode("Hello world, hello again.", add_special_tokens=False).ids
    anchor = tok.encode("Hello", add_special_tokens=False).ids
    for i in ids:  # an entry is what the token adds after whole text
        assert i not in table.texts or tok.decode(anchor + [i]) == tok.decode(anchor) + table.texts[i]


@pytest.mark.parametrize("decoder", [None, decoders.WordPiece(), decoders.BPEDecoder(),
                                     decoders.Sequence([decoders.Fuse(), decoders.Strip(" ", 0, 1)])])
def test_no_table_for_decoders_whose_text_depends_on_neighbours(decoder):
    """WordPiece joins "##" pieces and cleans up spaces; BPEDecoder spaces a word's end only when
    a token follows; a trailing Strip changes the last token; no decoder joins with spaces."""
    tok = Tokenizer.from_str(make_tokenizer().to_str())
    tok.decoder = decoder
    table = standalone_token_texts(tok)
    assert not table.texts and not table.joining


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_deltas_are_the_same_with_and_without_the_table(name, data):
    """Token by token, on any ids (special tokens, lone UTF-8 bytes, byte-fallback runs),
    with stop strings or none: the table changes nothing a client sees."""
    tok = TOKENIZERS[name]()
    table = _tables(name)
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40), label="ids")
    prompt = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), min_size=1, max_size=8), label="prompt")
    stop = data.draw(st.sampled_from([(), ("o w",), ("é",)]), label="stop")
    plain = IncrementalDetokenizer(tok, prompt, stop)
    fast = IncrementalDetokenizer(tok, prompt, stop, standalone=table)
    for i in ids:
        try:
            want = plain.step(i)
        except Exception:  # noqa: BLE001  DecodeStream itself gives up on some byte-fallback runs
            return
        assert fast.step(i) == want
        if plain.finished:
            break
    assert fast.finish() == plain.finish()
    assert fast.stop_matched == plain.stop_matched


@functools.cache
def _tables(name):
    return standalone_token_texts(TOKENIZERS[name]())


def test_table_tokens_skip_the_decoder(monkeypatch):
    """The point of the table: plain tokens are not decoded one window at a time."""
    calls = []

    class CountingStream:
        def __init__(self, **kwargs):
            self.inner = real(**kwargs)

        def step(self, tok, token_id):
            calls.append(token_id)
            return self.inner.step(tok, token_id)

    real = detokenize.DecodeStream
    monkeypatch.setattr(detokenize, "DecodeStream", CountingStream)
    tok = make_tokenizer()
    ids = tok.encode("Hello world, hello again. The world is big.", add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok, [0], standalone=standalone_token_texts(tok))
    assert "".join(d.step(i) for i in ids) + d.finish() == "Hello world, hello again. The world is big."
    assert calls == ids[:1]  # only the first token: until then the text may end inside a character


def test_include_stop_str_in_output_keeps_the_matched_stop():
    tok = make_tokenizer()
    ids = tok.encode("Hello world, the end.", add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok, tok.encode("Hi").ids, ["o w"], include_stop=True)
    text = "".join(d.step(t) for t in ids if not d.finished) + d.finish()
    assert text == "Hello w" and d.stop_matched == "o w"


def test_min_tokens_looks_for_stop_strings_only_after_them():
    tok = make_tokenizer()
    text = "the end. the end. the end."
    ids = tok.encode(text, add_special_tokens=False).ids
    first = len(tok.encode("the end.", add_special_tokens=False).ids)
    d = IncrementalDetokenizer(tok, tok.encode("Hi").ids, ["end"], min_tokens=first)
    out = "".join(d.step(t) for t in ids if not d.finished) + d.finish()
    assert out == "the end. the "  # the first "end" came within min_tokens: it could not stop the sequence
