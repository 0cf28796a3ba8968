"""Loading tokenizers offline: the embedded SmolLM2 GGUF, a GGUF path, a Hugging Face folder."""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

import pytest

from tests.fixtures.tokenizers import HAS_SMOLLM2, NO_SMOLLM2, save_tiny_hf_tokenizer
from tokenos.engine.input_processor import InputProcessor
from tokenos.engine.tokenizer import Tokenizer, load_tokenizer, read_gguf_metadata
from tokenos.model_loader.embedded import default_model_path

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=NO_SMOLLM2)
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


@needs_smollm2
def test_default_model_tokenizer(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152 == len(smollm2)
    assert smollm2.convert_ids_to_tokens([smollm2.eos_token_id]) == ["<|im_end|>"]
    assert smollm2.eos_token_id in smollm2.all_special_ids
    text = "Hello, world! 12 héllo 世界 🎉"
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text
    digits = smollm2.encode("1234", add_special_tokens=False)
    assert smollm2.convert_ids_to_tokens(digits) == ["1", "2", "3", "4"]


@needs_smollm2
def test_default_model_chat_template(smollm2: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = smollm2.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not smollm2.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    door = InputProcessor(smollm2, SimpleNamespace(max_model_len=2048, vocab_size=len(smollm2)))
    rendered = door.render_chat(messages)
    ids = rendered.token_ids
    assert rendered.text == text and ids == smollm2.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3  # <|im_start|> stays one token
    assert smollm2.apply_chat_template(messages, chat_template=TEMPLATE) == "<user>hi<a>"


@needs_smollm2
def test_gguf_path_and_metadata() -> None:
    path = default_model_path()
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.eos_token_id"] == 2 and "chat_template" in "".join(meta)
    assert load_tokenizer(path).encode("hi there") == load_tokenizer(os.path.dirname(path)).encode("hi there")


def test_hf_folder(tmp_path) -> None:
    save_tiny_hf_tokenizer(str(tmp_path), TEMPLATE)
    tok = load_tokenizer(str(tmp_path))
    assert tok.convert_ids_to_tokens([tok.eos_token_id]) == ["</s>"]
    assert set(tok.all_special_ids) == {0, 1}
    ids = tok.encode("hello 🎉")
    assert tok.decode(ids) == "hello 🎉"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x<a>"


def test_missing_chat_template_is_a_clear_error(tmp_path) -> None:
    save_tiny_hf_tokenizer(str(tmp_path), None)
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=TEMPLATE) == "<user>x<a>"


def test_bad_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path))  # an empty folder
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(ValueError, match="not a GGUF"):
        load_tokenizer(str(bad))


def test_gguf_reader_on_a_hand_written_file(tmp_path) -> None:
    def string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    kvs = [
        string("a.u32") + struct.pack("<II", 4, 7),
        string("a.str") + struct.pack("<I", 8) + string("héllo"),
        string("a.arr") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", -1, 0, 1),
        string("a.strs") + struct.pack("<IIQ", 9, 8, 2) + string("x") + string("yz"),
        string("a.f32") + struct.pack("<If", 6, 0.5),
        string("a.bool") + struct.pack("<I?", 7, True),
    ]
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    assert read_gguf_metadata(str(path)) == {
        "a.u32": 7,
        "a.str": "héllo",
        "a.arr": [-1, 0, 1],
        "a.strs": ["x", "yz"],
        "a.f32": 0.5,
        "a.bool": True,
    }
