"""What state each layer needs, how layers group, and how one pool of pages holds them all.

Specs. Every layer declares a spec: `FullAttentionSpec` (K and V for every token),
`SlidingWindowSpec` (K and V for the last `sliding_window` tokens), `MLAAttentionSpec` (multi-head
latent attention: ONE row per token, the compressed latent and the rotated rope key, serving as both
K and V) or `MambaSpec` (any fixed-size recurrent state: Mamba2, gated DeltaNet, short conv, linear
attention). Layers with
equal specs form a KV-cache group; the memory manager only ever sees specs and groups.

One pool. All groups take fixed-size pages from one pool of `num_blocks` blocks; a block id is
owned by at most one group (and one or more requests sharing a prefix) at a time. For a model
mixing attention and recurrent layers the page sizes are unified: the attention block size is
raised to a multiple of 16 until one attention page holds at least one recurrent state, then the
recurrent page is padded to the same byte size (and its checkpoint interval set to the attention
block size, so every group has a block boundary at the same token positions). Opt-in,
`mamba_checkpoint_interval` then sets the recurrent block size (the checkpoint interval, in tokens)
to a divisor or multiple of the attention block size: the page stays one size in bytes, and hits
between attention page boundaries copy the partial page (`tokenos.core.kv_cache.fine_prefix`).

Three block sizes, kept apart on purpose (mixing them up is a known source of silent bugs):
- kernel block size: tokens per attention page, `spec.block_size` of an attention group; the
  worker's block tables and slot mapping use it.
- hash block size: `KVCacheConfig.hash_block_size`, the granularity of the request's chained
  block hashes (gcd of all group block sizes); a group block of k hash blocks is named by the
  hash of its last hash block.
- scheduler alignment: `KVCacheConfig.scheduler_alignment`, the unit that non-final prompt chunks
  end on (lcm of the block sizes of recurrent groups in "align" mode; 1 otherwise), so that
  recurrent checkpoints land on block boundaries.

Memory layout (the worker's contract). Each `KVCacheTensor` is one flat byte buffer of
`num_blocks * page_size_bytes` bytes, viewed by every layer in `shared_by` with the BLOCK
DIMENSION OUTERMOST, so block b of every view is the byte range
`[b * page_size_bytes, (b + 1) * page_size_bytes)`:
- attention layers: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (K then V);
- MLA layers: `[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]` (latent, then rope key);
- recurrent layers: one view per state, `[num_blocks, *shapes[i]]` with dtype `dtypes[i]`,
  the states packed back to back from byte 0 of the page in the order given
  (`MambaSpec.state_offsets()` gives the byte offsets); the rest of the page is padding.
For hybrids one buffer is shared by one layer of each group, so all views tile memory
identically and a write through one view can only touch pages of the block it addresses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# float8_e4m3fn and int8: attention pages only (--kv-cache-dtype fp8 / int8).
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}
# Raised attention block sizes are multiples of this (what paged attention kernels tile by).
KERNEL_BLOCK_ALIGNMENT = 16
MAMBA_CACHE_MODES = ("align", "none", "all")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported KV-cache dtype {dtype!r}; choose one of {sorted(DTYPE_SIZES)}."
        ) from None


class KVCacheSpec:
    """Base of all specs: a page size and a worst-case memory need per request."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}.")
        _dtype_size(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * _dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek V2 / V3): every query head reads the same per-token row of
    ``head_size`` = ``kv_lora_rank + qk_rope_head_dim`` values (the normed latent, then the rotated rope
    key), which stands for both K and V, so a token costs one row where ordinary attention stores two.
    It is full attention to the memory manager (a subclass: same manager, same prefix caching); only
    the page size differs, and the pool unifies it with other specs by bytes per token."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(
                f"MLAAttentionSpec has one latent head per token, got num_kv_heads={self.num_kv_heads}."
            )

    @property
    def bytes_per_token(self) -> int:
        return self.head_size * _dtype_size(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"SlidingWindowSpec.sliding_window must be >= 1, got {self.sliding_window}.")

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        # The window plus the tokens of one step, +1 block because the window straddles blocks.
        step = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.sliding_window - 1 + step, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A fixed-size recurrent state. `block_size` is the checkpoint interval in tokens.

    cache_mode: "align" keeps the running state page plus the previous one and checkpoints where
    a step ends on a block boundary; "all" writes one checkpoint per block (a step crossing
    boundaries writes each of them) and, like "align", holds only the running page and the previous
    one once the checkpoints are published: older ones wait in the evictable cache; "none" keeps
    one page and disables prefix caching for the model. The memory bound of "all" stays the whole
    context, because admission reserves a page per block of the prompt.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    block_size: int
    cache_mode: str = "align"
    # Set by page-size unification: the page is padded to this many bytes (None: no padding).
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes."
            )
        if self.block_size < 1:
            raise ValueError(f"MambaSpec.block_size must be >= 1, got {self.block_size}.")
        if self.cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"MambaSpec.cache_mode must be one of {MAMBA_CACHE_MODES}, got {self.cache_mode!r}."
            )
        for (offset, _), dtype in zip(self.state_offsets(), self.dtypes, strict=True):
            if offset % _dtype_size(dtype):
                raise ValueError(
                    f"MambaSpec state of dtype {dtype} would start at byte {offset}, not a multiple "
                    "of its element size; order the states from the widest dtype to the narrowest."
                )
        if self.page_size_padded is not None and self.page_size_padded < self.state_bytes:
            raise ValueError(
                f"page_size_padded ({self.page_size_padded}) is smaller than the state ({self.state_bytes})."
            )

    def state_offsets(self) -> list[tuple[int, int]]:
        """(byte offset inside the page, byte size) of each state, packed in order from byte 0."""
        out = []
        offset = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            nbytes = math.prod(shape) * _dtype_size(dtype)
            out.append((offset, nbytes))
            offset += nbytes
        return out

    @property
    def state_bytes(self) -> int:
        return sum(n for _, n in self.state_offsets())

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.state_bytes

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        if self.cache_mode == "all":
            return cdiv(max_model_len, self.block_size) * self.page_size_bytes
        if self.cache_mode == "align":
            return 2 * self.page_size_bytes  # previous state (a checkpoint) + the running state
        return self.page_size_bytes


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheTensor:
    size_bytes: int
    # Layers viewing this buffer: one per group for hybrids, so pages tile memory identically.
    shared_by: list[str]


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    # Derived in __post_init__ when left None (see the module docstring for what each means).
    hash_block_size: int | None = None
    scheduler_alignment: int | None = None

    def __post_init__(self) -> None:
        if not self.kv_cache_groups:
            raise ValueError("KVCacheConfig needs at least one KV-cache group.")
        sizes = [g.kv_cache_spec.block_size for g in self.kv_cache_groups]
        if self.hash_block_size is None:
            self.hash_block_size = math.gcd(*sizes)
        for s in sizes:
            if s % self.hash_block_size:
                raise ValueError(
                    f"group block size {s} is not a multiple of hash_block_size {self.hash_block_size}."
                )
        if self.scheduler_alignment is None:
            aligned = [
                g.kv_cache_spec.block_size
                for g in self.kv_cache_groups
                if isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.cache_mode == "align"
            ]
            self.scheduler_alignment = math.lcm(*aligned) if aligned else 1

    @property
    def page_size_bytes(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.page_size_bytes

    @property
    def kernel_block_sizes(self) -> list[int]:
        """Tokens per page of each group, in group order (what block tables index by)."""
        return [g.kv_cache_spec.block_size for g in self.kv_cache_groups]


# ---------------------------------------------------------------- building a config


def unify_page_sizes(specs: list[KVCacheSpec]) -> dict[KVCacheSpec, KVCacheSpec]:
    """Map each distinct spec to a spec with the common page size (see the module docstring)."""
    attn = [s for s in specs if isinstance(s, AttentionSpec)]
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    others = [s for s in specs if not isinstance(s, AttentionSpec | MambaSpec)]
    if others:
        raise ValueError(f"unknown KV-cache spec type {type(others[0]).__name__}.")
    out: dict[KVCacheSpec, KVCacheSpec] = {}
    if attn:
        per_token = {s.bytes_per_token for s in attn}
        block_sizes = {s.block_size for s in attn}
        if len(per_token) > 1 or len(block_sizes) > 1:
            raise ValueError(
                "attention layers with different page sizes (bytes per token "
                f"{sorted(per_token)}, block sizes {sorted(block_sizes)}) cannot share one pool yet."
            )
        bpt, block_size = per_token.pop(), block_sizes.pop()
        if mamba:
            state = max(s.state_bytes for s in mamba)
            if block_size * bpt < state:
                unit = KERNEL_BLOCK_ALIGNMENT * bpt
                block_size = cdiv(state, unit) * KERNEL_BLOCK_ALIGNMENT
        page = block_size * bpt
        for s in attn:
            out[s] = replace(s, block_size=block_size)
        for s in mamba:
            out[s] = replace(s, block_size=block_size, page_size_padded=page)
    else:
        page = max(s.state_bytes for s in mamba)
        for s in mamba:
            out[s] = replace(s, page_size_padded=page if page != s.state_bytes else None)
    return out


def set_checkpoint_interval(
    unified: dict[KVCacheSpec, KVCacheSpec], interval: int
) -> dict[KVCacheSpec, KVCacheSpec]:
    """Give every MambaSpec the checkpoint interval `interval` (its block size) while the page stays
    the attention page: the interval is a token count, the page a byte size, so they are independent.

    The interval must divide the attention block size or be a multiple of it, so that every
    interval boundary is a hash-block boundary and `hash_block_size` = gcd stays a useful grain.
    """
    if interval < 1:
        raise ValueError(f"mamba_checkpoint_interval must be >= 1, got {interval}.")
    attn_sizes = {s.block_size for s in unified.values() if isinstance(s, AttentionSpec)}
    for b in attn_sizes:
        if b % interval and interval % b:
            raise ValueError(
                f"mamba_checkpoint_interval={interval} neither divides nor is a multiple of the "
                f"attention block size {b} (raised so a page holds a recurrent state); pick e.g. "
                f"{math.gcd(b, interval) or b}."
            )
    return {k: replace(s, block_size=interval) if isinstance(s, MambaSpec) else s for k, s in unified.items()}


def group_layers(layer_specs: dict[str, KVCacheSpec]) -> tuple[list[KVCacheGroupSpec], list[list[str]]]:
    """Groups of equal-spec layers, and for each shared buffer the layers (one per group) viewing it.

    With one spec, one group holds every layer and each layer gets its own buffer. With several,
    every group holds at most `g` layers, g = the smallest layer count of any spec (bigger specs
    split into several groups), and buffer i is shared by layer i of every group.
    """
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    if len(by_spec) == 1:
        ((spec, names),) = by_spec.items()
        return [KVCacheGroupSpec(list(names), spec)], [[n] for n in names]
    group_size = min(len(v) for v in by_spec.values())
    groups = [
        KVCacheGroupSpec(names[i : i + group_size], spec)
        for spec, names in by_spec.items()
        for i in range(0, len(names), group_size)
    ]
    shared = [[g.layer_names[i] for g in groups if i < len(g.layer_names)] for i in range(group_size)]
    return groups, shared


def get_kv_cache_config(
    layer_specs: dict[str, KVCacheSpec],
    *,
    available_memory_bytes: int | None,
    num_blocks: int | None,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    mamba_checkpoint_interval: int | None = None,
) -> KVCacheConfig:
    """Group the layers, unify page sizes and size the pool.

    `num_blocks` wins over `available_memory_bytes` when both are given. Raises ValueError when
    the pool cannot hold one request of `max_model_len` tokens (plus the null block).
    `mamba_checkpoint_interval` (None: the unified attention block size) decouples the recurrent
    checkpoint interval from the attention page size, see `set_checkpoint_interval`.
    """
    if not layer_specs:
        raise ValueError("the model declared no KV-cache layers.")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
    unified = unify_page_sizes(list(dict.fromkeys(layer_specs.values())))
    if mamba_checkpoint_interval is not None:
        unified = set_checkpoint_interval(unified, mamba_checkpoint_interval)
    groups, shared = group_layers({name: unified[spec] for name, spec in layer_specs.items()})
    page = groups[0].kv_cache_spec.page_size_bytes
    bytes_per_block = page * len(shared)
    if num_blocks is None:
        if available_memory_bytes is None:
            raise ValueError("get_kv_cache_config needs available_memory_bytes or num_blocks.")
        num_blocks = available_memory_bytes // bytes_per_block
    need = sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens), page)
        for g in groups
    )
    if num_blocks - 1 < need:
        where = (
            f"{num_blocks} blocks were requested"
            if available_memory_bytes is None
            else f"{available_memory_bytes} bytes of KV-cache memory give {num_blocks} blocks"
        )
        raise ValueError(
            f"the KV cache is too small: {where} of {bytes_per_block} bytes ({len(groups)} groups, "
            f"{len(shared)} buffers of {page}-byte pages), but one request of max_model_len="
            f"{max_model_len} tokens needs {need} blocks plus the null block ({(need + 1) * bytes_per_block} "
            "bytes). Give the KV cache more memory or lower max_model_len."
        )
    tensors = [KVCacheTensor(num_blocks * page, names) for names in shared]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, kv_cache_tensors=tensors)
