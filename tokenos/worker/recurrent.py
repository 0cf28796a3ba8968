"""What the worker does each step for recurrent KV-cache groups (MambaSpec), apart from its own internals.

Idea (the scheduler's contract in ``tokenos/core/outputs.py``): a request with ``n`` computed tokens that
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
the layers write them from the same scan (``tokenos.models.hybrid.CheckpointingBatch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenos.core.kv_cache.spec import KVCacheConfig, MambaSpec
from tokenos.layers.short_conv import RecurrentBatch
from tokenos.models.hybrid import CheckpointingBatch

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
) -> RecurrentBatch:
    """The step's metadata for one recurrent group, its layers' state pools addressed by page id.

    ``query_start_loc`` [num_reqs + 1] cuts the flat token stream into requests (the same one attention
    uses); ``running_block_ids[r]`` is request r's page of column ``(n + k - 1) // B``. A request with
    ``num_computed == 0`` starts from zeros whatever its page holds (a recycled page needs no clearing).
    "all" mode: also pass ``checkpoint_pages`` (``boundary_pages(...)``) and the group's ``block_size``.
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
    kwargs = dict(state_indices=torch.from_numpy(running), num_computed_tokens=torch.from_numpy(num_computed))
    if checkpoint_pages is None:
        return RecurrentBatch(*args, **kwargs)
    if block_size is None:
        raise ValueError("checkpoint_pages need the group's block_size")
    if np.any(np.asarray(checkpoint_pages) == NULL_BLOCK):
        raise ValueError('an "all"-mode checkpoint page is the null block: the block list is too short')
    pages = torch.as_tensor(np.asarray(checkpoint_pages, dtype=np.int64))
    return CheckpointingBatch(*args, checkpoint_every=block_size, checkpoint_pages=pages, **kwargs)


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
            src_page, dst_page = blocks[src], blocks[dst]
            if NULL_BLOCK in (src_page, dst_page):
                raise ValueError(
                    f"request {req_id!r} group {g}: state copy {src}->{dst} touches the null block"
                )
            srcs, dsts = pages.setdefault(g, ([], []))
            srcs.append(src_page)
            dsts.append(dst_page)
    for g, (srcs, dsts) in pages.items():
        src_idx, dst_idx = torch.tensor(srcs), torch.tensor(dsts)
        for i in group_layers[g]:
            for pool in kv_caches[i]:
                # index_select materializes the sources before any destination is written.
                pool.index_copy_(0, dst_idx, pool.index_select(0, src_idx))
    return sum(len(s) for s, _ in pages.values())


def group_layer_indices(config: KVCacheConfig, layer_order: list[str]) -> dict[int, list[int]]:
    """Recurrent group id -> indices into ``layer_order`` (the ``kv_caches`` order) of its layers."""
    index = {name: i for i, name in enumerate(layer_order)}
    return {
        g: [index[name] for name in group.layer_names]
        for g, group in enumerate(config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, MambaSpec)
    }
