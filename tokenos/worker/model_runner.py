"""Runs the model for one scheduler step: persistent batch in, sampled tokens out.

Each step: apply the scheduler's diff to the persistent batch (`_update_states`), lay out
the flat token batch (input ids, positions, slot mapping, block tables) with numpy, run
the model over the paged KV cache, sample the last position of every request whose
prompt is complete, and append the sampled tokens to the batch rows. Requests still in
the middle of their prompt (a partial chunk) get nothing sampled.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenos.core.kv_cache.spec import KVCacheConfig
from tokenos.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenos.layers.attention import AttentionMetadata, make_attention_metadata
from tokenos.layers.short_conv import RecurrentBatch
from tokenos.models import build_model
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import HybridMetadata
from tokenos.sample.sampler import Sampler, compute_prompt_logprobs
from tokenos.worker.input_batch import CachedRequestState, InputBatch
from tokenos.worker.kv_cache import allocate_kv_caches
from tokenos.worker.recurrent import (
    apply_prefix_page_copies,
    apply_state_copies,
    boundary_pages,
    build_recurrent_batch,
    group_layer_indices,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        seed: int = 0,
        mamba_cache_mode: str = "align",
    ) -> None:
        torch.manual_seed(seed)
        self.mamba_cache_mode = mamba_cache_mode
        self.model_config = model_config
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = model_config.max_model_len
        self.model = build_model(model_config)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch: InputBatch | None = None
        self.group_block_sizes: list[int] = []

    def get_kv_cache_spec(self) -> dict:
        if getattr(self.model, "is_hybrid", False):
            return self.model.get_kv_cache_spec(self.block_size, self.mamba_cache_mode)
        return self.model.get_kv_cache_spec(self.block_size)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        specs = self.get_kv_cache_spec()
        self.kv_caches = allocate_kv_caches(kv_cache_config, list(specs))
        self.group_block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        group_of = {
            name: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for name in grp.layer_names
        }
        self.layer_group = [group_of[name] for name in specs]  # KV-cache group of each model layer
        self.group_layer_names = [list(grp.layer_names) for grp in kv_cache_config.kv_cache_groups]
        self.recurrent_groups = group_layer_indices(kv_cache_config, list(specs))
        self.is_hybrid = bool(getattr(self.model, "is_hybrid", False))
        max_blocks = [-(-self.max_model_len // bs) for bs in self.group_block_sizes]
        self.input_batch = InputBatch(
            self.max_num_seqs, self.max_model_len, max_blocks, self.model_config.vocab_size
        )

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        assert batch is not None
        gone = list(so.finished_req_ids | so.preempted_req_ids)
        for req_id in gone:
            self.requests.pop(req_id, None)
        # Requests not scheduled this step leave the batch but keep their state.
        scheduled = so.num_scheduled_tokens
        unscheduled = [r for r in batch.req_id_to_index if r not in scheduled]
        batch.remove_requests(gone + unscheduled)

        for new in so.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids),
                eos_token_id=getattr(new, "eos_token_id", None),
            )
            self.requests[new.req_id] = state
            if new.req_id in batch.req_id_to_index:
                batch.remove_requests([new.req_id])
            batch.add_request(state)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            removed = cached.removed_block_idx[i] if cached.removed_block_idx else None
            if removed is not None:
                for g, indices in enumerate(removed):
                    for j in indices:
                        state.block_ids[g][j] = 0
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                for group_ids, added in zip(state.block_ids, new_ids, strict=True):
                    group_ids.extend(added)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                batch.add_request(state)
                continue
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if removed is not None:
                for table, indices in zip(batch.block_tables, removed, strict=True):
                    table.table[row, list(indices)] = 0
            if new_ids is not None:
                for table, added in zip(batch.block_tables, new_ids, strict=True):
                    if added:
                        table.append(row, added)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        batch = self.input_batch
        assert batch is not None
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [])
        n = batch.num_reqs
        req_ids = [r for r in batch.req_ids[:n]]
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        num_computed = batch.num_computed_tokens[:n].astype(np.int64)

        cu = np.cumsum(num_sched)
        starts = cu - num_sched
        total = int(cu[-1])
        # positions: num_computed[row] + 0..num_sched[row]-1, laid out flat
        offsets = np.arange(total) - np.repeat(starts, num_sched)
        rows = np.repeat(np.arange(n), num_sched)
        positions = np.repeat(num_computed, num_sched) + offsets
        input_ids = batch.token_ids[rows, positions]

        if so.prefix_page_copies:  # copy-on-write of partial prefix-hit pages, before anything else
            layer_group = self.layer_group
            layers_of = {g: [i for i, lg in enumerate(layer_group) if lg == g] for g in set(layer_group)}
            apply_prefix_page_copies(
                so.prefix_page_copies,
                lambda req_id, g: self.requests[req_id].block_ids[g],
                layers_of,
                self.kv_caches,
            )
        if so.mamba_state_copies:
            apply_state_copies(
                so.mamba_state_copies,
                lambda req_id, g: self.requests[req_id].block_ids[g],
                self.recurrent_groups,
                self.kv_caches,
            )
        attn_metadata = self._build_metadata(n, rows, positions, num_sched, num_computed)
        hidden = self.model(
            torch.from_numpy(input_ids), torch.from_numpy(positions), attn_metadata, self.kv_caches
        )

        seq_after = num_computed + num_sched
        sample_mask = seq_after >= batch.num_tokens[:n]
        logits_idx = torch.from_numpy(cu - 1)
        logits = self.model.compute_logits(hidden[logits_idx])
        # rows still mid-prompt sample nothing; their seeded generators must not advance
        discard = np.flatnonzero(~sample_mask).tolist()
        sampler_out = self.sampler(logits, batch.sampling.make_metadata(n, discard_rows=discard))
        sampled = sampler_out.sampled_token_ids.tolist()

        sampled_lists: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] = []
        for row in range(n):
            if sample_mask[row]:
                tok = sampled[row]
                sampled_lists.append([tok])
                batch.append_token(row, tok)
                self.requests[req_ids[row]].output_token_ids.append(tok)
                lp = sampler_out.logprobs[row] if sampler_out.logprobs else None
                logprobs.append([lp] if lp is not None else None)
            else:
                sampled_lists.append([])
                logprobs.append(None)
        for row in range(n):
            batch.num_computed_tokens[row] = seq_after[row]
            self.requests[req_ids[row]].num_computed_tokens = int(seq_after[row])

        prompt_logprobs = self._prompt_logprobs(hidden, req_ids, starts, num_sched, num_computed)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_lists,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _build_metadata(
        self,
        n: int,
        rows: np.ndarray,
        positions: np.ndarray,
        num_sched: np.ndarray,
        num_computed: np.ndarray,
    ):
        """One metadata object per KV-cache group, shaped the way the model takes it."""
        per_group = [
            self._recurrent_metadata(g, n, num_sched, num_computed)
            if g in self.recurrent_groups
            else self._attention_metadata(g, n, rows, positions, num_sched, num_computed)
            for g in range(len(self.group_block_sizes))
        ]
        if self.is_hybrid:
            return HybridMetadata.from_groups(self.group_layer_names, per_group)
        if len(per_group) == 1:
            return per_group[0]
        return [per_group[g] for g in self.layer_group]

    def _recurrent_metadata(
        self, g: int, n: int, num_sched: np.ndarray, num_computed: np.ndarray
    ) -> RecurrentBatch:
        """The running state page of each request: column (n + k - 1) // B of its block list."""
        table = self.input_batch.block_tables[g]
        block_size = self.group_block_sizes[g]
        if self.mamba_cache_mode == "none":
            columns = np.zeros(n, dtype=np.int64)
        else:
            columns = np.maximum(num_computed + num_sched - 1, 0) // block_size
        running = table.table[np.arange(n), columns].astype(np.int64)
        qsl = np.concatenate(([0], np.cumsum(num_sched)))
        if self.mamba_cache_mode != "all":
            return build_recurrent_batch(qsl, num_computed, num_sched, running)
        # "all": also write the state at every block boundary crossed to that column's page.
        pages = boundary_pages(table.table[:n], num_computed, num_sched, block_size)
        return build_recurrent_batch(qsl, num_computed, num_sched, running, pages, block_size)

    def _attention_metadata(
        self,
        g: int,
        n: int,
        rows: np.ndarray,
        positions: np.ndarray,
        num_sched: np.ndarray,
        num_computed: np.ndarray,
    ) -> AttentionMetadata:
        table = self.input_batch.block_tables[g]
        block_size = self.group_block_sizes[g]
        width = max(int(table.num_blocks[:n].max()), 1)
        block_table = table.table[:n, :width]
        slots = block_table[rows, positions // block_size].astype(np.int64) * block_size
        slots += positions % block_size
        seq_lens = num_computed + num_sched
        return make_attention_metadata(
            torch.from_numpy(block_table),
            num_sched.tolist(),
            seq_lens.tolist(),
            torch.from_numpy(slots),
            block_size,
        )

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        starts: np.ndarray,
        num_sched: np.ndarray,
        num_computed: np.ndarray,
    ) -> dict[str, list[TokenLogprobs | None]]:
        """Logprobs of prompt tokens 1..P-1, for the prompt positions computed this step."""
        batch = self.input_batch
        out: dict[str, list[TokenLogprobs | None]] = {}
        for row in sorted(batch.prompt_logprobs_rows):
            if row >= len(req_ids):
                continue
            req_id = req_ids[row]
            n_prompt = int(batch.num_prompt_tokens[row])
            first = int(num_computed[row])
            # position p predicts token p+1; only positions < n_prompt - 1 score a prompt token
            last = min(first + int(num_sched[row]), n_prompt - 1)
            if last <= first:
                continue
            idx = torch.arange(int(starts[row]), int(starts[row]) + last - first)
            logits = self.model.compute_logits(hidden[idx])
            targets = torch.from_numpy(batch.token_ids[row, first + 1 : last + 1].copy())
            num_top = self.requests[req_id].sampling_params.prompt_logprobs or 0
            scored = list(compute_prompt_logprobs(logits, targets, num_top))
            # the first prompt token has no logprob (nothing precedes it)
            out[req_id] = ([None] if first == 0 else []) + scored
        return out
