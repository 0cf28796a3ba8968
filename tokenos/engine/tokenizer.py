"""Loading a tokenizer, from a Hugging Face folder or from inside a GGUF file, offline.

The frontend needs four things from a tokenizer: text -> ids, ids -> text, the chat template,
and which ids are special (EOS above all). `Tokenizer` wraps a `transformers` tokenizer and
exposes only those, so the rest of the engine never sees `transformers`' wide API.

A GGUF file has no `tokenizer.json`: its vocabulary, merges, special ids and chat template are
metadata under llama.cpp's key names. `transformers` can rebuild a tokenizer from them, but its
own metadata reader takes seconds on a 100k-entry vocabulary, so we read the metadata section
ourselves (a flat run of key/value pairs before the tensor table: ~0.1 s) and hand the result to
`transformers`' converters. Nothing is written to disk.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from collections.abc import Sequence
from typing import Any

from tokenos.model_loader.embedded import default_model_path


class Tokenizer:
    """The tokenizer as the engine sees it. Decoding goes through the Rust backend when there is one
    (no Python-side clean-up of spaces), so `decode` is exactly what incremental detokenization
    reproduces piece by piece."""

    def __init__(self, hf_tokenizer: Any, name: str = "") -> None:
        self.hf = hf_tokenizer
        self.name = name
        self.backend = getattr(hf_tokenizer, "backend_tokenizer", None)  # tokenizers.Tokenizer or None
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.all_special_ids: list[int] = sorted(set(hf_tokenizer.all_special_ids))
        # len() counts added tokens, which `.vocab_size` leaves out for some tokenizers.
        self.vocab_size: int = len(hf_tokenizer)
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None)

    def __len__(self) -> int:
        return self.vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of this vocabulary can stand for (its longest entry: byte-level
        entries spell one byte per character, so they are never shorter than the text they cover)."""
        return max((len(token) for token in self.hf.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.backend is not None:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` as the prompt text (the front door encodes it, `tokenos.engine.input_processor`).

        The rendered text already holds whatever BOS the template writes, so encode it with
        `add_special_tokens=False`.
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"The tokenizer of {self.name or 'this model'} has no chat template; pass one "
                "(chat_template=...) or send a plain prompt instead of chat messages."
            )
        text = self.hf.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        return text


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, a `.gguf` file, or (None) the embedded default model."""
    if path is None:
        path = default_model_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return Tokenizer(_load_gguf_tokenizer(path), name=path)
    if os.path.isdir(path):
        if _has_hf_tokenizer_files(path):
            from transformers import AutoTokenizer

            return Tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), name=path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return Tokenizer(_load_gguf_tokenizer(os.path.join(path, ggufs[0])), name=path)
    raise FileNotFoundError(
        f"Cannot find a tokenizer at {path!r}: expected a folder with tokenizer.json or "
        "tokenizer_config.json, a folder holding exactly one .gguf file, or a .gguf file."
    )


def _has_hf_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.isfile(os.path.join(folder, n)) for n in names)


# ---------------------------------------------------------------- GGUF


def _load_gguf_tokenizer(path: str) -> Any:
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # a transformers without these internals: its (slower) public path
        from transformers import AutoTokenizer

        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)

    metadata = read_gguf_metadata(path)
    architecture, tokenizer_dict, tokenizer_config = _gguf_tokenizer_dicts(metadata, GGUF_TOKENIZER_MAPPING)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _gguf_tokenizer_dicts(
    metadata: dict[str, Any], mapping: dict[str, dict[str, str]]
) -> tuple[str, dict, dict]:
    """`(architecture, tokenizer_dict, tokenizer_config)` the way `transformers`' converters want them."""
    meta = {k.removeprefix("tokenizer."): v for k, v in metadata.items() if k.startswith("tokenizer.")}
    tokenizer_dict = {name: meta[k] for k, name in mapping["tokenizer"].items() if k in meta}
    tokenizer_config = {name: meta[k] for k, name in mapping["tokenizer_config"].items() if k in meta}
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    special = (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))
    for name, key in special:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            tokenizer_config[name] = tokens[token_id]
    return metadata.get("general.architecture", ""), tokenizer_dict, tokenizer_config


# GGUF metadata value types: fixed-size scalars by struct code; 8 is a string, 9 an array.
_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2/v3), read straight from a memory map.

    Layout: magic "GGUF", u32 version, u64 tensor count, u64 kv count, then kv pairs of
    (string key, u32 type, value); strings are u64 length + UTF-8 bytes, arrays are u32 element
    type + u64 count + elements. We stop before the tensor table.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version}).")
        reader = _GgufReader(buf, 24)
        metadata = {}
        for _ in range(n_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("I"))
        return metadata


class _GgufReader:
    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        start, self.pos = self.pos, self.pos + n
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self.string()
        if value_type == _GGUF_ARRAY:
            elem_type, count = self.scalar("I"), self.scalar("Q")
            if elem_type in _GGUF_SCALAR:  # one unpack for the whole array
                code = _GGUF_SCALAR[elem_type]
                values = list(struct.unpack_from(f"<{count}{code}", self.buf, self.pos))
                self.pos += count * struct.calcsize(code)
                return values
            return [self.value(elem_type) for _ in range(count)]
        if value_type in _GGUF_SCALAR:
            return self.scalar(_GGUF_SCALAR[value_type])
        raise ValueError(f"Unknown GGUF metadata value type {value_type}.")
