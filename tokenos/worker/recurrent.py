"""What the worker does each step for recurrent KV-cache groups (MambaSpec), apart from its own internals.

Idea (the scheduler's contract in ``tokenos/core/sched/output.py``): a request with ``n`` computed tokens that
runs ``k`` new ones keeps its running recurrent state in the page of column ``s = (n + k - 1) // B``
(``s = 0`` in "none" mode). Each step, per recurrent group:

1. ``apply_state_copies``: before the forward, copy every state of every layer of the group from page
   ``block_ids[src]`` to page ``block_ids[dst]`` for each ``(src, dst)`` in ``mamba_state_copies`` (adopting a
   checkpoint, or moving the running state to a new column). Gathers all sources first, then scatters, so
   one copy's destination is never read as another's source in the same step.
2. ``build_recurrent_batch``: the ``RecurrentBatch`` the group's layers share, with ``state_indices`` = each
   request's running page (``running_block_ids``) and ``has_initial_state = n > 0``; the layers read the
   initial state from that page and write the final state back to it, in place in the pool.

Three helpers keep the column arithmetic in one place: ``running_column``, ``running_block_ids`` (from
per-request block lists) and ``group_layer_indices`` (group id -> indices into the per-layer cache list).
"all" mode also writes the state after every block boundary ``b`` (``n < b <= n + k``) to page
``block_ids[b // B - 1]``: pass ``boundary_pages(...)`` and the block size to ``build_recurrent_batch``;
the layers write them from the same scan (``RecurrentBatch.checkpoint_pages``).

``apply_prefix_page_copies`` runs first of all: the copy-on-write of prefix-hit pages that are not on a
page boundary (``SchedulerOutput.prefix_page_copies``; attention or recurrent groups alike: a whole-page
copy from a source block id into a column of the request's list).

Speculative decoding: recurrent state cannot be truncated like attention K/V. The verify pass keeps the
state after every verified position of each request with drafts (``build_recurrent_batch(...,
verify_reqs=...)``, `RecurrentBatch.verify_reqs`); once j drafts are accepted, ``commit_verified`` writes
the state after its j + 1 kept tokens into the page of column ``running_column(n, j + 1)``, where the
scheduler's contract looks for it next step: a select, no second pass, and rejected drafts leave no trace.
(``rollback`` is the older alternative, restore a checkpoint and re-advance the accepted tokens with a
second forward; the engine does not use it.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenos.core.kv_cache.spec import KVCacheConfig, MambaSpec
from tokenos.layers.recurrent_batch import RecurrentBatch

NULL_BLOCK = 0


def running_column(num_computed: int, num_scheduled: int, block_size: int, cache_mode: str = "align") -> int:
    """Column of the page holding the state after ``num_computed + num_scheduled`` tokens."""
    if cache_mode == "none":
        return 0
    return max(num_computed + num_scheduled - 1, 0) // block_size


def running_block_ids(
    block_ids: Sequence[Sequence[int]],
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
    block_size: int,
    cache_mode: str = "align",
) -> np.ndarray:
    """``block_ids[r][running_column(...)]`` per request of one group (NULL_BLOCK for a request with
    nothing scheduled: it is not read). ``block_ids[r]`` is the request's list for that group."""
    out = np.zeros(len(block_ids), dtype=np.int64)
    for r, blocks in enumerate(block_ids):
        if num_scheduled[r] > 0:
            out[r] = blocks[
                running_column(int(num_computed[r]), int(num_scheduled[r]), block_size, cache_mode)
            ]
    return out


def boundary_pages(
    block_ids: Sequence[Sequence[int]], num_computed: np.ndarray, num_scheduled: np.ndarray, block_size: int
) -> np.ndarray:
    """ "all" mode: the page of every block boundary ``b`` with ``n < b <= n + k``, by request then position
    (the order ``RecurrentBatch.checkpoint_positions`` uses): ``block_ids[r][b // block_size - 1]``."""
    pages = []
    for blocks, n, k in zip(block_ids, num_computed, num_scheduled, strict=True):
        first = int(n) // block_size + 1
        pages.extend(blocks[j - 1] for j in range(first, (int(n) + int(k)) // block_size + 1))
    return np.asarray(pages, dtype=np.int64)


def build_recurrent_batch(
    query_start_loc: torch.Tensor | np.ndarray,
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
    running_block_ids: np.ndarray,
    checkpoint_pages: np.ndarray | None = None,
    block_size: int | None = None,
    verify_reqs: list[int] | None = None,
) -> RecurrentBatch:
    """The step's metadata for one recurrent group, its layers' state pools addressed by page id.

    ``query_start_loc`` [num_reqs + 1] cuts the flat token stream into requests (the same one attention
    uses); ``running_block_ids[r]`` is request r's page of column ``(n + k - 1) // B``. A request with
    ``num_computed == 0`` starts from zeros whatever its page holds (a recycled page needs no clearing).
    "all" mode: also pass ``checkpoint_pages`` (``boundary_pages(...)``) and the group's ``block_size``.
    ``verify_reqs``: the requests verifying speculative drafts (their every state is kept for
    ``commit_verified``).
    """
    num_computed = np.asarray(num_computed, dtype=np.int64)
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    running = np.asarray(running_block_ids, dtype=np.int64)
    if not len(num_computed) == len(num_scheduled) == len(running):
        raise ValueError("num_computed, num_scheduled and running_block_ids need one entry per request")
    bad = np.nonzero((num_scheduled > 0) & (running == NULL_BLOCK))[0]
    if len(bad):
        raise ValueError(
            f"requests {bad.tolist()} are scheduled but their running recurrent page is the null "
            "block: the block list does not reach column (n + k - 1) // block_size"
        )
    qsl = torch.as_tensor(np.asarray(query_start_loc), dtype=torch.long)
    lengths = (qsl[1:] - qsl[:-1]).numpy()
    if not np.array_equal(lengths, num_scheduled):
        raise ValueError(
            f"query_start_loc lengths {lengths.tolist()} != num_scheduled {num_scheduled.tolist()}"
        )
    args = (qsl, torch.from_numpy(num_computed > 0))
    kwargs = dict(
        state_indices=torch.from_numpy(running),
        num_computed_tokens=torch.from_numpy(num_computed),
        verify_reqs=verify_reqs,
    )
    if checkpoint_pages is None:
        return RecurrentBatch(*args, **kwargs)
    if block_size is None:
        raise ValueError("checkpoint_pages need the group's block_size")
    if np.any(np.asarray(checkpoint_pages) == NULL_BLOCK):
        raise ValueError('an "all"-mode checkpoint page is the null block: the block list is too short')
    pages = torch.as_tensor(np.asarray(checkpoint_pages, dtype=np.int64))
    return RecurrentBatch(*args, checkpoint_every=block_size, checkpoint_pages=pages, **kwargs)


def apply_state_copies(
    copies: dict[str, dict[int, tuple[int, int]]],
    block_ids_of: Callable[[str, int], Sequence[int]],
    group_layers: dict[int, list[int]],
    kv_caches: list,
) -> int:
    """Copy page ``block_ids_of(req, g)[src]`` to ``[dst]`` for every state of every layer of group g.

    ``copies`` is ``SchedulerOutput.mamba_state_copies`` (req_id -> group id -> (src, dst) column indices);
    ``group_layers[g]`` lists the indices into ``kv_caches`` of group g's layers (each a list of state pools
    ``[num_blocks, *shape]``). Must run after the step's block lists are updated (new requests added, new
    block ids appended, removed indices zeroed: the source column is never removed in the same step) and
    before the forward. Returns the number of page copies per layer made.
    """
    pages: dict[int, tuple[list[int], list[int]]] = {}
    for req_id, per_group in copies.items():
        for g, (src, dst) in per_group.items():
            blocks = block_ids_of(req_id, g)
            _add_page_copy(pages, g, blocks[src], blocks[dst], f"request {req_id!r} group {g}: state copy")
    return _copy_pages(pages, group_layers, kv_caches)


def _add_page_copy(
    pages: dict[int, tuple[list[int], list[int]]], g: int, src: int, dst: int, what: str
) -> None:
    if NULL_BLOCK in (src, dst):
        raise ValueError(f"{what} {src}->{dst} touches the null block")
    srcs, dsts = pages.setdefault(g, ([], []))
    srcs.append(src)
    dsts.append(dst)


def _copy_pages(
    pages: dict[int, tuple[list[int], list[int]]], group_layers: dict[int, list[int]], kv_caches
) -> int:
    """Copy page ids ``srcs -> dsts`` of group g in every page-indexed tensor of its layers; returns the
    number of pages copied per layer."""
    for g, (srcs, dsts) in pages.items():
        src_idx, dst_idx = torch.tensor(srcs), torch.tensor(dsts)
        for i in group_layers[g]:
            for pool in _pools(kv_caches[i]):
                # index_select materializes the sources before any destination is written.
                pool.index_copy_(0, dst_idx, pool.index_select(0, src_idx))
    return sum(len(s) for s, _ in pages.values())


def _pools(cache) -> list[torch.Tensor]:
    """The page-indexed tensors of one layer's cache: an attention tensor, or its list of state pools."""
    return list(cache) if isinstance(cache, list | tuple) else [cache]


def apply_prefix_page_copies(
    copies: dict[str, dict[int, tuple[int, int]]],
    block_ids_of: Callable[[str, int], Sequence[int]],
    group_layers: dict[int, list[int]],
    kv_caches: list,
) -> int:
    """Copy page ``src`` (a block id) into page ``block_ids_of(req, g)[dst]`` for every layer of group g.

    ``copies`` is ``SchedulerOutput.prefix_page_copies`` (req_id -> group id -> (src block id, dst column));
    ``group_layers[g]`` lists the indices into ``kv_caches`` of group g's layers, attention or recurrent.
    Run after the block lists are updated and before ``apply_state_copies``. Returns the pages copied.
    """
    pages: dict[int, tuple[list[int], list[int]]] = {}
    for req_id, per_group in copies.items():
        for g, (src_page, dst) in per_group.items():
            dst_page = block_ids_of(req_id, g)[dst]
            _add_page_copy(pages, g, src_page, dst_page, f"request {req_id!r} group {g}: prefix page copy")
    return _copy_pages(pages, group_layers, kv_caches)


def commit_verified(
    batch: RecurrentBatch,
    num_kept: Sequence[int],
    block_table: np.ndarray,
    block_size: int,
    cache_mode: str = "align",
) -> int:
    """After speculative verification: make the state after each verifying request's kept tokens its
    running state. ``num_kept[r]`` is how many of request r's new tokens stand (accepted drafts + 1; 0:
    none, the request failed and its pages are not trusted). The state after them, kept by the verify pass
    (`RecurrentBatch.keep_verified`), is copied into page ``block_table[r, running_column(n, kept)]`` of
    every layer of the group: the column the next step's state copy reads (with drafts crossing a page
    boundary and some rejected, an earlier column than the verify pass ended in). Returns the requests
    whose running page was written.
    """
    if not batch.verify_reqs:
        return 0
    index: list[int] = []
    pages: list[int] = []
    offset = 0
    for r in batch.verify_reqs:
        n, k, kept = batch.num_computed_tokens[r], batch.lengths[r], int(num_kept[r])
        if not 0 <= kept <= k:
            raise ValueError(f"request {r} kept {kept} of its {k} verified tokens")
        page = int(block_table[r, running_column(n, kept, block_size, cache_mode)])
        # All kept and still the same page: the pass already left that state there.
        if kept and (kept < k or page != int(batch.state_rows[r])):
            if page == NULL_BLOCK:
                raise ValueError(f"request {r}: its page for the state after {n + kept} tokens is null")
            index.append(offset + kept - 1)
            pages.append(page)
        offset += k
    if not pages:
        return 0
    idx, dst = torch.tensor(index), torch.tensor(pages)
    for conv_pool, state_pool, conv, state in batch.verified:
        conv_pool.index_copy_(0, dst, conv.index_select(0, idx).to(conv_pool.dtype))
        state_pool.index_copy_(0, dst, state.index_select(0, idx).to(state_pool.dtype))
    return len(pages)


def restore_checkpoint(layer_caches: Sequence, checkpoint_page: int, running_page: int) -> None:
    """Overwrite every state of ``running_page`` with the checkpoint in ``checkpoint_page`` (all layers
    of one recurrent group: each entry of ``layer_caches`` is a layer's list of state pools)."""
    if NULL_BLOCK in (checkpoint_page, running_page):
        raise ValueError("restore_checkpoint: the checkpoint or running page is the null block")
    if checkpoint_page == running_page:
        return
    for cache in layer_caches:
        for pool in _pools(cache):
            pool[running_page].copy_(pool[checkpoint_page])


def readvance_batch(num_checkpoint_tokens: int, num_accepted: int, running_page: int) -> RecurrentBatch:
    """The one-request batch that advances ``num_accepted`` tokens from the state after
    ``num_checkpoint_tokens`` tokens held in ``running_page`` (zeros when that count is 0)."""
    return build_recurrent_batch(
        np.array([0, num_accepted]),
        np.array([num_checkpoint_tokens]),
        np.array([num_accepted]),
        np.array([running_page]),
    )


def rollback(
    layer_caches: Sequence,
    checkpoint_page: int,
    running_page: int,
    num_checkpoint_tokens: int,
    accepted_inputs: torch.Tensor,
    advance: Callable[[torch.Tensor, RecurrentBatch], torch.Tensor],
) -> torch.Tensor:
    """Speculative-decoding rollback: restore the checkpoint into the running page, then re-advance only
    the accepted tokens (``advance(inputs, batch)`` runs the group's layers, e.g. a model forward, and
    writes the new state into ``running_page``). Returns what ``advance`` returns (their outputs)."""
    restore_checkpoint(layer_caches, checkpoint_page, running_page)
    if len(accepted_inputs) == 0:
        return accepted_inputs
    batch = readvance_batch(num_checkpoint_tokens, len(accepted_inputs), running_page)
    return advance(accepted_inputs, batch)


def group_layer_indices(config: KVCacheConfig, layer_order: list[str]) -> dict[int, list[int]]:
    """Recurrent group id -> indices into ``layer_order`` (the ``kv_caches`` order) of its layers."""
    index = {name: i for i, name in enumerate(layer_order)}
    return {
        g: [index[name] for name in group.layer_names]
        for g, group in enumerate(config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, MambaSpec)
    }
