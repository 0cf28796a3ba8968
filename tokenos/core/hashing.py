"""Prefix hashing: a block's identity is the hash of the whole prefix that ends at its boundary.

`hash_block_tokens(hash_fn, parent, token_ids, extra_keys)` hashes a triple, and a request's
hashes are a chain (`parent` is the previous block's hash), so equal hashes mean equal prefixes,
not merely equal tokens: KV depends on everything before it.

Stability: the bytes fed to the hash are an explicit encoding (little-endian int64 token ids with
a length prefix, msgpack for extra keys), never Python's `hash()`, so hashes are the same in every
process and independent of PYTHONHASHSEED. Functions: `sha256` (default, collision-resistant:
a collision would serve one prompt's KV to another), `xxhash` (xxh3_128, much faster, 128-bit),
`blake2b` (32-byte digest, no extra dependency).

Extra keys separate tenants and adapters: the request's `cache_salt` is folded into the FIRST
block only (every later block inherits it through the chain) and the adapter id into every block.

Hashes are computed incrementally at `hash_block_size` granularity (see
`tokenos.core.kv_cache.spec.KVCacheConfig.hash_block_size`); a group whose block is k hash
blocks long names its block j by hash `(j + 1) * k - 1`, the prefix ending at its boundary.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

BlockHash = bytes
HashFn = Callable[[bytes], bytes]


class HashedTokens(Protocol):
    """What hashing reads of a request (`tokenos.core.request.Request`): its tokens, the hashes so far,
    and the extra keys. A protocol, so hashing sits below the request it names."""

    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    cache_salt: str | None
    adapter_id: int | str | None


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _xxhash(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


_HASH_FNS: dict[str, HashFn] = {"sha256": _sha256, "blake2b": _blake2b, "xxhash": _xxhash}


def get_hash_fn(name: str) -> HashFn:
    """The block-hash function called `name` (sha256, xxhash or blake2b)."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of {sorted(_HASH_FNS)}.") from None


_none_hashes: dict[HashFn, bytes] = {}


def none_hash(hash_fn: HashFn) -> bytes:
    """The parent of a request's first block: a fixed seed, the same in every process."""
    h = _none_hashes.get(hash_fn)
    if h is None:
        h = _none_hashes[hash_fn] = hash_fn(b"tokenos-none-hash")
    return h


_structs: dict[int, struct.Struct] = {}
_encode_extra = msgspec.msgpack.Encoder().encode


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """H(parent, token_ids, extra_keys) with an explicit, process-independent byte encoding."""
    n = len(token_ids)
    st = _structs.get(n)
    if st is None:
        st = _structs[n] = struct.Struct(f"<I{n}q")
    data = (parent_hash or none_hash(hash_fn)) + st.pack(n, *token_ids)
    if extra_keys:
        data += _encode_extra(extra_keys)
    return hash_fn(data)


def block_extra_keys(block_index: int, cache_salt: str | None, adapter_id: int | str | None) -> tuple | None:
    """Extra keys of block `block_index`: the adapter on every block, the salt on the first only."""
    if block_index == 0 and cache_salt is not None:
        return (adapter_id, cache_salt) if adapter_id is not None else (None, cache_salt)
    if adapter_id is not None:
        return (adapter_id,)
    return None


def make_block_hasher(hash_block_size: int, hash_fn: HashFn) -> Callable[[HashedTokens], list[BlockHash]]:
    """A function returning the hashes of a request's blocks that became full since last call."""

    def hasher(request: HashedTokens) -> list[BlockHash]:
        hashes = request.block_hashes
        start = len(hashes) * hash_block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        out: list[BlockHash] = []
        while start + hash_block_size <= len(tokens):
            extra = block_extra_keys(start // hash_block_size, request.cache_salt, request.adapter_id)
            parent = hash_block_tokens(hash_fn, parent, tokens[start : start + hash_block_size], extra)
            out.append(parent)
            start += hash_block_size
        return out

    hasher.hash_block_size = hash_block_size  # type: ignore[attr-defined]
    return hasher


def exact_prefix_hash(hash_fn: HashFn, request: HashedTokens, length: int, hash_block_size: int) -> BlockHash:
    """Key of the prefix `all_token_ids[:length]` for any length: the hash-block hash when `length`
    is on the hash grid, else H(last grid hash, the tail tokens) (distinct from every grid hash,
    since the token count is part of the encoding). Used for end-of-request checkpoints."""
    i, tail = divmod(length, hash_block_size)
    if not tail:
        return request.block_hashes[i - 1]
    parent = request.block_hashes[i - 1] if i else None
    tokens = request.all_token_ids[i * hash_block_size : length]
    extra = block_extra_keys(i, request.cache_salt, request.adapter_id)
    return hash_block_tokens(hash_fn, parent, tokens, extra)
