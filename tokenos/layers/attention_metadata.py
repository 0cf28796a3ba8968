"""`AttentionMetadata`: everything index-shaped about one step's attention, computed once per KV-cache group.

A step mixes decodes (query_len == 1) and prefill chunks (query_len > 1, maybe after a cached prefix) in
any order. From the group's block table, per-request lengths and slot mapping the worker builds one
`AttentionMetadata`; every attention layer of the group then reads it: where this step's K/V go
(``slot_mapping``), the decodes grouped by similar context length (padding each to its group's longest adds
at most a third more work), the prefill chunks and their cached prefix, and (built on first use, then
cached for the other layers) the flat-cache rows, masks and tile biases the kernels need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One request with query_len > 1: tokens [start, end) of the step, after ``num_computed``."""

    req_index: int
    start: int
    end: int
    num_computed: int
    # Slots of positions [0, seq_len); None when there is no cached prefix, in which case the
    # chunk attends to its own fresh K/V directly.
    slots: torch.Tensor | None

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.end - self.start


@dataclass
class DecodeGroup:
    """Decodes of similar length, attended together over K/V padded to ``max_len``."""

    tokens: slice | torch.Tensor  # their token indices in the step
    seq_lens: torch.Tensor  # int64 [n]
    slots: torch.Tensor  # int64 [n, max_len]; padding points at slot 0 (the null block)
    max_len: int

    @property
    def size(self) -> int:
        return len(self.seq_lens)


# A decode joins the current group while its length is at least this fraction of the group's longest.
DECODE_GROUP_MIN_FILL = 0.75


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer of the forward."""

    num_reqs: int
    num_actual_tokens: int
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], tokens in the cache after this step
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset
    prefills: list[PrefillChunk]  # requests with query_len > 1
    # int64 [num_blocks] page versions (tokenos/worker/kv_cache.py PageEpochs), or None: lets cascade
    # attention keep packed prefixes between steps.
    page_epochs: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)  # masks and row indices, built on first use

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        """Requests with query_len == 1 for the torch path, grouped by length. Built on first use
        only: their padded slot tensors grow with batch x context, and the C kernel never needs them."""
        if "decode_groups" not in self._cache:
            qsl = self.query_start_loc.tolist()
            self._cache["decode_groups"] = _decode_groups(
                self.block_table, self.query_lens_list, self.seq_lens_list, qsl, self.block_size
            )
        return self._cache["decode_groups"]

    def decode_batch(self) -> tuple[torch.Tensor | slice, torch.Tensor, torch.Tensor] | None:
        """All decodes at once for the C kernel: (token selector, block-table rows, seq lens)."""
        if "decode_batch" not in self._cache:
            reqs = [r for r, n in enumerate(self.query_lens_list) if n == 1]
            if not reqs:
                self._cache["decode_batch"] = None
            else:
                qsl = self.query_start_loc.tolist()
                index = torch.tensor(reqs)
                self._cache["decode_batch"] = (
                    _token_selector([qsl[r] for r in reqs]),
                    self.block_table.index_select(0, index).to(torch.int32).contiguous(),
                    self.seq_lens.index_select(0, index).to(torch.int32).contiguous(),
                )
        return self._cache["decode_batch"]

    def prefill_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All prefill chunks for the C kernel: int32 [n, 3] rows of (first token, query length,
        cached tokens before it), and their block-table rows int32 [n, max_blocks]."""
        if "prefill_batch" not in self._cache:
            rows = [(c.start, c.end - c.start, c.num_computed) for c in self.prefills]
            index = torch.tensor([c.req_index for c in self.prefills])
            self._cache["prefill_batch"] = (
                torch.tensor(rows, dtype=torch.int32),
                self.block_table.index_select(0, index).to(torch.int32).contiguous(),
            )
        return self._cache["prefill_batch"]

    def chunks_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request as a chunk for the C prefill kernel, decodes included (batch invariance: one
        kernel, so one arithmetic, for every query): `prefill_batch`'s layout."""
        if "chunks_batch" not in self._cache:
            qsl = self.query_start_loc.tolist()
            lens = zip(self.query_lens_list, self.seq_lens_list, strict=True)
            rows = [(qsl[r], n, s - n) for r, (n, s) in enumerate(lens)]
            self._cache["chunks_batch"] = (
                torch.tensor(rows, dtype=torch.int32),
                self.block_table.to(torch.int32).contiguous(),
            )
        return self._cache["chunks_batch"]

    def _rows(self, slots: torch.Tensor, rows_per_block: int) -> torch.Tensor:
        """Flat-cache rows of K for ``slots`` followed by those of V, as one index."""
        k_rows = (slots // self.block_size) * rows_per_block + slots % self.block_size
        return torch.cat((k_rows, k_rows + self.block_size))

    def write_rows(self, rows_per_block: int) -> torch.Tensor:
        """int64 [2 * num_tokens]: where this step's K then V go."""
        key = ("write", rows_per_block)
        if key not in self._cache:
            self._cache[key] = self._rows(self.slot_mapping, rows_per_block)
        return self._cache[key]

    def decode_rows(self, i: int, rows_per_block: int) -> torch.Tensor:
        """int64 [2 * size * max_len]: decode group i's padded K then V rows."""
        key = ("decode_rows", i, rows_per_block)
        if key not in self._cache:
            self._cache[key] = self._rows(self.decode_groups[i].slots.reshape(-1), rows_per_block)
        return self._cache[key]

    def prefill_rows(self, i: int, rows_per_block: int) -> torch.Tensor:
        key = ("prefill_rows", i, rows_per_block)
        if key not in self._cache:
            self._cache[key] = self._rows(self.prefills[i].slots, rows_per_block)
        return self._cache[key]

    def decode_mask(self, i: int, window: int | None) -> torch.Tensor:
        """bool [size, 1, 1, max_len] for decode group i: real (and in-window) cache positions."""
        key = ("decode", i, window)
        if key not in self._cache:
            group = self.decode_groups[i]
            pos = torch.arange(group.max_len)
            lens = group.seq_lens[:, None]
            mask = pos < lens
            if window is not None:
                mask &= pos >= lens - window
            self._cache[key] = mask[:, None, None, :]
        return self._cache[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """bool [chunk length, sequence length]: which keys each query of chunk i sees (causal,
        aligned to the end of its cached prefix, and within the window); None when plain causal
        attention over the chunk alone is exactly that (no prefix, no window)."""
        chunk = self.prefills[i]
        if chunk.num_computed == 0 and window is None:
            return None
        key = ("prefill_mask", i, window)
        if key not in self._cache:
            q_pos = torch.arange(chunk.num_computed, chunk.seq_len)[:, None]
            k_pos = torch.arange(chunk.seq_len)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            self._cache[key] = allowed
        return self._cache[key]


def _slots(block_table_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of ``positions`` [n, L] given each row's block-table row [n, max_blocks]."""
    blocks = torch.gather(block_table_rows, 1, positions // block_size).long()
    return blocks * block_size + positions % block_size


def make_attention_metadata(
    block_table: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    slot_mapping: torch.Tensor,
    block_size: int,
    page_epochs: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Precompute every per-step index from a block table, per-request lengths and slots."""
    num_reqs = len(query_lens)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=qsl[-1],
        block_size=block_size,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        block_table=block_table,
        slot_mapping=slot_mapping.long(),
        prefills=_prefill_chunks(block_table, query_lens, seq_lens, qsl, block_size),
        page_epochs=page_epochs,
    )


def _token_selector(tokens: list[int]) -> slice | torch.Tensor:
    """A slice when the tokens are consecutive (a view, no copy), else an index tensor."""
    if tokens and tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        return slice(tokens[0], tokens[0] + len(tokens))
    return torch.tensor(tokens, dtype=torch.int64)


def _decode_groups(
    block_table: torch.Tensor, query_lens: list[int], seq_lens: list[int], qsl: list[int], block_size: int
) -> list[DecodeGroup]:
    """Decodes by descending length, cut where a length drops below the fill fraction."""
    decodes = sorted((r for r in range(len(query_lens)) if query_lens[r] == 1), key=lambda r: -seq_lens[r])
    groups: list[list[int]] = []
    for r in decodes:
        if not groups or seq_lens[r] < DECODE_GROUP_MIN_FILL * seq_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(r)
    # Back in step order inside a group: consecutive decodes then select their tokens by a slice.
    return [_decode_group(block_table, sorted(g), seq_lens, qsl, block_size) for g in groups]


def _decode_group(
    block_table: torch.Tensor, reqs: list[int], seq_lens: list[int], qsl: list[int], block_size: int
) -> DecodeGroup:
    lens = torch.tensor([seq_lens[r] for r in reqs], dtype=torch.int64)
    max_len = int(lens.max())
    rows = block_table[torch.tensor(reqs)]
    pos = torch.arange(max_len).expand(len(reqs), max_len)
    slots = _slots(rows, pos.clamp(max=rows.shape[1] * block_size - 1), block_size)
    slots = slots.masked_fill(pos >= lens[:, None], 0)
    return DecodeGroup(_token_selector([qsl[r] for r in reqs]), lens, slots, max_len)


def _prefill_chunks(
    block_table: torch.Tensor, query_lens: list[int], seq_lens: list[int], qsl: list[int], block_size: int
) -> list[PrefillChunk]:
    chunks = []
    for r, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        num_computed = seq_lens[r] - q_len
        slots = None
        if num_computed > 0:
            slots = _slots(block_table[r : r + 1], torch.arange(seq_lens[r])[None], block_size)[0]
        chunks.append(PrefillChunk(r, qsl[r], qsl[r + 1], num_computed, slots))
    return chunks


def build_attention_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_size: int,
    max_blocks: int | None = None,
) -> AttentionMetadata:
    """Metadata from plain lists: request r has ``num_computed[r]`` tokens cached in
    ``block_tables[r]`` and runs ``num_scheduled[r]`` new ones this step."""
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled, strict=True)]
    width = max_blocks or max((len(b) for b in block_tables), default=1) or 1
    for blocks, n in zip(block_tables, seq_lens, strict=True):
        if len(blocks) * block_size < n or len(blocks) > width:
            raise ValueError(
                f"{len(blocks)} blocks cannot hold {n} tokens (block_size {block_size}, max {width})"
            )
    block_table = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for r, blocks in enumerate(block_tables):
        block_table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    req = torch.repeat_interleave(
        torch.arange(len(num_scheduled)), torch.tensor(num_scheduled, dtype=torch.int64)
    )
    starts = torch.tensor([0, *num_scheduled], dtype=torch.int64).cumsum(0)[:-1]
    pos = torch.arange(len(req)) - starts[req] + torch.tensor(num_computed, dtype=torch.int64)[req]
    slots = block_table[req, pos // block_size].long() * block_size + pos % block_size
    return make_attention_metadata(block_table, num_scheduled, seq_lens, slots, block_size)
