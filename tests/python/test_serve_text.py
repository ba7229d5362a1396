"""moelink-serve's incremental detokenization (server._IncrementalText):
the text of output tokens added a few at a time equals decoding them all at
once, for the tiny model's word-level tokenizer and for a byte-level BPE
whose characters span several tokens (CJK, emoji), whatever the chunking;
text ending in an incomplete character is held until the character is
whole."""

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from moelink.serve.server import _IncrementalText  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "naïve café déjà vu — 東京の天気は晴れです。🙂🚀 mixed ASCII and 多字节 text 👩‍👩‍👧",
         "  leading spaces,\ttabs\nand newlines\n\n  end  "]


def _byte_level():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocabulary: most multi-byte characters stay split over byte tokens.
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _word_level(tmp_path):
    from moelink.serve.tiny_model import write_tiny_model
    write_tiny_model(str(tmp_path), layers=1, seed=5)
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


def _chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = int(rng.integers(1, 4))
        yield ids[i:i + n], i + n >= len(ids)
        i += n


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_the_whole_decode(tmp_path, seed):
    rng = np.random.default_rng(seed)
    word, bl = _word_level(tmp_path), _byte_level()
    cases = [(bl, bl.encode(t).ids) for t in TEXTS]
    cases.append((word, [int(t) for t in rng.integers(4, word.get_vocab_size(), 40)]))
    for tok, ids in cases:
        inc = _IncrementalText(tok)
        for chunk, last in _chunks(ids, rng):
            before = inc.text
            inc.add(chunk, final=last)
            assert inc.text.startswith(before)  # text is only ever appended
            assert "\ufffd" not in inc.text  # no half character is ever shown
        assert inc.text == tok.decode(ids)


def test_an_incomplete_character_waits_for_its_last_byte():
    tok = _byte_level()
    ids = tok.encode("🙂").ids
    assert len(ids) > 1, "the emoji should span several byte tokens at this vocabulary"
    inc = _IncrementalText(tok)
    inc.add(ids[:1])
    assert inc.text == ""  # a partial UTF-8 sequence is not shown
    inc.add(ids[1:], final=True)
    assert inc.text == "🙂"
