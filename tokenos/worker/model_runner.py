"""Runs the model for one scheduler step: persistent batch in, sampled tokens out.

Each step: apply the scheduler's diff to the persistent batch (`_update_states`), bring the scheduled
requests to rows [0, n), lay out the flat token batch (input ids, positions) and one metadata object per
KV-cache group (`AttentionMetadata` for attention groups, `RecurrentBatch` for recurrent ones) with
numpy, make the copy-on-write and state copies the scheduler asked for, run the model on one
`ForwardBatch`, sample the last position of every request whose prompt is complete, and append the
sampled tokens to the batch rows. Requests still in the middle of their prompt (a partial chunk) get
nothing sampled. The model never sees groups: `ForwardBatch` gives each of its cache layers its own entry.

Per-row constraints on the logits, before the sampler: grammar bitmasks (the structured-output rows);
in the sampler: allowed token ids, bad words, and the engine's custom logits processors (built here,
once, from the classes the engine was given, and told the batch's changes every step).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

from tokenos.config import CacheConfig, LoRAConfig, SchedulerConfig
from tokenos.core.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaSpec, cdiv
from tokenos.core.sched.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenos.core.spec_decode import SpeculativeConfig
from tokenos.layers import cpu_kernels
from tokenos.layers.attention import Attention
from tokenos.layers.attention_metadata import AttentionMetadata, make_attention_metadata
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.quantization import weight_bytes
from tokenos.layers.recurrent_batch import RecurrentBatch
from tokenos.lora.manager import LoRAManager
from tokenos.models import build_model
from tokenos.models.config import ModelConfig
from tokenos.platform import (
    configure_threads,
    cpu_summary,
    dtype_name,
    kv_cache_dtype_name,
    native_bf16_supported,
    torch_dtype,
)
from tokenos.sample import ops
from tokenos.sample.logits_processor import EngineConfig, LogitsProcessor, build_logits_processors
from tokenos.sample.metadata import SamplingMetadata
from tokenos.sample.rejection import RejectionSampler, accept_greedy
from tokenos.sample.sampler import Sampler, compute_prompt_logprobs
from tokenos.worker.batch_invariance import check_batch_invariant
from tokenos.worker.draft_model import DraftModel, drafter_specs
from tokenos.worker.input_batch import InputBatch
from tokenos.worker.kv_cache import PageEpochs, allocate_kv_caches
from tokenos.worker.mtp import MtpDrafter
from tokenos.worker.recurrent import (
    apply_prefix_page_copies,
    apply_state_copies,
    boundary_pages,
    build_recurrent_batch,
    commit_verified,
)
from tokenos.worker.step_inputs import StepInputs, prepare_step_inputs, slot_mapping

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        seed: int = 0,
        logits_processors: Sequence[type[LogitsProcessor]] = (),
        scheduler_config: SchedulerConfig | None = None,
        lora_config: LoRAConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        """``logits_processors``: custom processor classes (`tokenos.sample.logits_processor`), each built
        once with the engine's configs (``scheduler_config`` among them). ``lora_config``: serve LoRA
        adapters (`tokenos.lora`); the adapters themselves are registered on ``self.lora``.
        ``speculative_config`` with method "draft_model" or "mtp": the drafter is loaded here beside the
        model (`tokenos.worker.draft_model`, `tokenos.worker.mtp`: the target's own MTP layer); other
        methods propose in the engine core."""
        torch.manual_seed(seed)
        self.num_threads = configure_threads()
        self.model_config = model_config
        self.cache_config = cache_config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = model_config.max_model_len
        self.model = build_model(model_config)
        self.drafter: DraftModel | MtpDrafter | None = None
        method = speculative_config.method if speculative_config is not None else None
        if method == "draft_model":
            self.drafter = DraftModel(model_config, speculative_config)
        elif method == "mtp":
            self.drafter = MtpDrafter(model_config, speculative_config, self.model)
        # Draft q of the drafts proposed last step, per request (sampling requests only).
        self.draft_probs: dict[str, torch.Tensor] = {}
        calculate_kv_scales = getattr(cache_config, "calculate_kv_scales", False)
        drafter_modules = self.drafter.model.modules() if self.drafter is not None else ()
        for layer in (*self.model.modules(), *drafter_modules):
            if isinstance(layer, Attention):  # int8 pages calibrate whatever this says
                layer.calculate_kv_scales = calculate_kv_scales
        self.lora = LoRAManager(self.model, lora_config, model_config.dtype) if lora_config else None
        self.adapter_of: dict[str, str] = {}  # req id -> its adapter key (LoRA requests in the batch)
        # Requests whose adapter could not be loaded as they joined the batch: they fail this step.
        self.adapter_failures: dict[str, str] = {}
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.logits_processor_classes = list(logits_processors)
        self.scheduler_config = scheduler_config or SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=model_config.max_model_len,
        )
        self.kv_caches: list = []
        self.input_batch: InputBatch | None = None
        self.group_specs: list[KVCacheSpec] = []

    def describe_kernels(self) -> str:
        """What runs here, for the start-up log: dtype, CPU, threads, and which fast paths are on."""
        # MLA layers (DeepSeek) attend in torch: the C kernel serves `Attention` layers only.
        c_kernel = cpu_kernels.load() is not None and any(
            isinstance(m, Attention) for m in self.model.modules()
        )
        return (
            f"dtype {dtype_name(self.model_config.dtype)} on {cpu_summary()} "
            f"(native bf16: {'yes' if native_bf16_supported() else 'no'}), {self.num_threads} threads; "
            f"{self._describe_weights()}; "
            f"linears: {self._describe_linears()}; "
            f"decode attention: {self._decode_kernel(c_kernel)}; "
            f"prefill attention: {self._prefill_kernel()}"
            + ("; batch invariant" if cpu_kernels.batch_invariant() else "")
        )

    def check_batch_invariant(self) -> None:
        """Refuse batch invariance (``TOKENOS_BATCH_INVARIANT=1``) where it cannot hold for this model."""
        check_batch_invariant(self.model, self.model_config.dtype)

    def _describe_linears(self) -> str:
        modules = list(self.model.modules())
        kinds = [
            name
            for name, attr in (("quantized", "quantized"), ("oneDNN packed", "packed"))
            if any(getattr(m, attr, None) for m in modules)  # a dict of experts: empty until quantized
        ]
        if "quantized" in kinds and self.model_config.dtype == torch.bfloat16 and cpu_kernels.uses_amx():
            rows = "1 row" if cpu_kernels.batch_invariant() else "2 rows"
            kinds[kinds.index("quantized")] = f"quantized (AMX tiles from {rows})"
        return " + ".join(kinds) or "F.linear"

    def _decode_kernel(self, c_kernel: bool) -> str:
        if not c_kernel:
            return "torch"
        kv_dtype = getattr(self.cache_config, "cache_dtype", "auto")
        pages = torch_dtype(kv_cache_dtype_name(kv_dtype, dtype_name(self.model_config.dtype)))
        return "C kernel + cascade over shared pages" if cpu_kernels.uses_cascade(pages) else "C kernel"

    def _describe_weights(self) -> str:
        """Resident weight bytes, and which are quantized (and run by which kernel)."""
        total, quantized, kinds = weight_bytes(self.model)
        text = f"weights {total / 2**20:.1f} MiB"
        if not kinds:
            return text
        kernel = "C kernel" if cpu_kernels.qgemm_kernel(self.model_config.dtype) is not None else "torch"
        count = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        method = self.model_config.quantization
        return f"{text} ({quantized / 2**20:.1f} MiB quantized, {method}: {count} tensors, {kernel})"

    def _prefill_kernel(self) -> str:
        """The C prefill kernel where every attention layer takes it (bf16 on AVX512-BF16), else SDPA."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        kv_dtype = getattr(self.cache_config, "cache_dtype", "auto")
        if self.model_config.dtype != torch.bfloat16 or not layers or kv_dtype == "float32":
            return "torch SDPA"  # the C kernel reads bf16, fp8 and int8 pages
        shapes = {(m.num_heads, m.num_kv_heads, m.head_size) for m in layers}
        if not all(cpu_kernels.prefill_supported(*s) for s in shapes):
            return "torch SDPA"
        amx = cpu_kernels.uses_amx() and all(d % 32 == 0 for _, _, d in shapes)
        return "C kernel (AMX tiles)" if amx else "C kernel"

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """The model's cache layers' specs, then the drafter's (named ``drafter.*``, or ``mtp.*`` for the MTP
        layer), in entry order."""
        specs = self.model.get_kv_cache_spec(self.cache_config)
        if self.drafter is None:
            return specs
        # The MTP keeps no recurrent state: on a hybrid it only adds attention pages of the target's shape.
        hybrid_ok = isinstance(self.drafter, MtpDrafter)
        return {**specs, **drafter_specs(specs, self.drafter.get_kv_cache_spec(self.cache_config), hybrid_ok)}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        entries = list(self.get_kv_cache_spec())
        self.kv_caches = allocate_kv_caches(kv_cache_config, entries)
        self.page_epochs = PageEpochs(kv_cache_config.num_blocks)
        groups = kv_cache_config.kv_cache_groups
        self.group_specs = [g.kv_cache_spec for g in groups]
        group_of = {name: g for g, grp in enumerate(groups) for name in grp.layer_names}
        # KV-cache group of each pool entry, and each group's entries (what page copies touch).
        self.entry_groups = [group_of[name] for name in entries]
        self.group_entries = {
            g: [i for i, eg in enumerate(self.entry_groups) if eg == g] for g in range(len(groups))
        }
        if self.drafter is not None:
            first = len(entries) - sum(1 for name in entries if name.startswith(self.drafter.prefix))
            groups_of_drafter = self.entry_groups[first:]
            sizes = {g: self.group_specs[g].block_size for g in groups_of_drafter}
            self.drafter.bind(groups_of_drafter, sizes)
        max_blocks = [cdiv(self.max_model_len, spec.block_size) for spec in self.group_specs]
        config = EngineConfig(self.model_config, self.scheduler_config, self.cache_config)
        self.input_batch = InputBatch(
            self.max_num_seqs,
            self.max_model_len,
            max_blocks,
            self.model_config.vocab_size,
            logitsprocs=build_logits_processors(self.logits_processor_classes, config),
        )

    # ------------------------------------------------------------------ state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        assert batch is not None
        gone = scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
        batch.remove_requests(gone)
        if self.adapter_of:
            for req_id in gone:
                self._leave_adapter(req_id)
        self._bump_page_epochs(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            if new.adapter_id is not None:
                self._join_adapter(new.req_id, str(new.adapter_id))
            batch.remove_requests((new.req_id,))  # resumed after a preemption: rebuilt from scratch
            batch.add_request(
                new.req_id,
                new.prompt_token_ids,
                new.output_token_ids,
                new.num_computed_tokens,
                new.block_ids,
                new.sampling_params,
                new.eos_token_id,
                new.stop_token_ids,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            batch.update_request(
                req_id, cached.num_computed_tokens[i], cached.removed_block_idx[i], cached.new_block_ids[i]
            )

    def _bump_page_epochs(self, scheduler_output: SchedulerOutput) -> None:
        """Every page handed to a request this step may be written: its packed copies go stale."""
        handed = [b for new in scheduler_output.scheduled_new_reqs for ids in new.block_ids for b in ids]
        for added in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if added is not None:
                handed.extend(b for ids in added for b in ids)
        self.page_epochs.bump(handed)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_masks: dict[str, np.ndarray] | None = None
    ) -> ModelRunnerOutput:
        """One step. ``grammar_masks``: req id -> int32 bitmask row (bit t = token t allowed) for the
        structured-output requests that sample this step; every other token of their row is made
        unpickable before any sampling stage."""
        self._update_states(scheduler_output)
        batch = self.input_batch
        assert batch is not None
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [])
        scheduled = scheduler_output.num_scheduled_tokens
        n = batch.gather_scheduled(scheduled)
        if self.lora is not None:
            self._order_by_adapter(n)
        batch.update_logits_processors(n)
        req_ids: list[str] = batch.req_ids[:n]  # type: ignore[assignment]
        drafts = self._place_drafts(scheduler_output.scheduled_spec_decode_tokens, req_ids)
        inputs = prepare_step_inputs(
            batch.token_ids, batch.num_computed_tokens[:n], [scheduled[r] for r in req_ids]
        )
        if self.lora is not None:
            self.lora.set_step(self._adapter_segments(req_ids, inputs), len(inputs.input_ids))

        self._copy_pages(scheduler_output)
        verify = [row for row, d in enumerate(drafts) if d] if drafts is not None else None
        group_metadata = [
            self._group_metadata(g, spec, inputs, verify) for g, spec in enumerate(self.group_specs)
        ]
        forward_batch = ForwardBatch.for_groups(
            torch.from_numpy(inputs.input_ids),
            torch.from_numpy(inputs.positions),
            self.kv_caches,
            group_metadata,
            self.entry_groups,
        )
        hidden = self.model(forward_batch)
        if isinstance(self.drafter, DraftModel):  # the MTP runs after sampling: it reads the next tokens
            self.drafter.run_step(forward_batch, self._drafter_caches())
        if drafts is not None:
            out = self._verify_drafts(hidden, inputs, req_ids, drafts, grammar_masks, forward_batch)
            self._commit_recurrent(group_metadata, out.sampled_token_ids)
            return out

        seq_after = inputs.seq_lens
        sample_mask = seq_after >= batch.num_tokens[:n]
        # rows still mid-prompt sample nothing; their seeded generators must not advance
        discard = np.flatnonzero(~sample_mask).tolist()
        metadata = batch.sampling.make_metadata(n, discard_rows=discard)
        rows = hidden[torch.from_numpy(inputs.last_token_indices)]
        greedy = self._head_argmax(rows) if not grammar_masks and _argmax_only(metadata) else None
        if greedy is not None:
            sampled, sampled_logprobs, failed = greedy, [None] * n, {}
        else:
            logits = self.model.compute_logits(rows)
            if grammar_masks:
                apply_grammar_masks(logits, req_ids, grammar_masks)
            sampled, sampled_logprobs, failed = self._sample(logits, metadata, req_ids)
        failed = self._failed_adapters(failed)

        sampled_lists: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] = []
        for row in range(n):
            if sample_mask[row] and req_ids[row] not in failed:
                tok = sampled[row]
                sampled_lists.append([tok])
                batch.append_token(row, tok)
                lp = sampled_logprobs[row]
                logprobs.append([lp] if lp is not None else None)
            else:
                sampled_lists.append([])
                logprobs.append(None)
        batch.num_computed_tokens[:n] = seq_after
        return self._output(hidden, req_ids, inputs, sampled_lists, logprobs, failed, forward_batch)

    # ------------------------------------------------------------------ LoRA

    def _join_adapter(self, req_id: str, key: str) -> None:
        """A request of adapter ``key`` joins the batch: its weights are loaded now (`LoRAManager`).
        Where that fails (its files changed on disk) the request runs as a base-model row this step,
        its output discarded, and fails alone."""
        if req_id in self.adapter_of:
            return
        try:
            self.lora.activate(key)
        except (ValueError, OSError) as e:
            self.adapter_failures[req_id] = f"LoRA adapter could not be loaded: {e}"
            return
        self.adapter_of[req_id] = key

    def _leave_adapter(self, req_id: str) -> None:
        key = self.adapter_of.pop(req_id, None)
        if key is not None:
            self.lora.deactivate(key)
        self.adapter_failures.pop(req_id, None)

    def _failed_adapters(self, failed: dict[str, str]) -> dict[str, str]:
        """``failed`` plus this step's requests whose adapter did not load."""
        if not self.adapter_failures:
            return failed
        failed = {**failed, **self.adapter_failures}
        self.adapter_failures.clear()
        return failed

    def _order_by_adapter(self, n: int) -> None:
        """Rows [0, n) grouped by adapter (base-model rows first), so each adapter's tokens are one
        contiguous segment of the flat batch. Rows stay put between steps, so this is usually no swap."""
        if not self.adapter_of:
            return
        batch = self.input_batch
        adapter_of = self.adapter_of
        keys = [str(adapter_of.get(r, "")) for r in batch.req_ids[:n]]
        batch.order_rows(sorted(range(n), key=keys.__getitem__))

    def _adapter_segments(self, req_ids: list[str], inputs: StepInputs) -> list[tuple[str, int, int]]:
        segments: list[tuple[str, int, int]] = []
        if not self.adapter_of:
            return segments
        starts, ends = inputs.query_start.tolist(), inputs.query_end.tolist()
        for row, req_id in enumerate(req_ids):
            key = self.adapter_of.get(req_id)
            if key is None:
                continue
            if segments and segments[-1][0] == key:
                segments[-1] = (key, segments[-1][1], ends[row])
            else:
                segments.append((key, starts[row], ends[row]))
        return segments

    def _output(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        inputs: StepInputs,
        sampled: list[list[int]],
        logprobs: list[list[TokenLogprobs] | None],
        failed: dict[str, str],
        forward_batch: ForwardBatch,
    ) -> ModelRunnerOutput:
        drafts = self._propose(req_ids, sampled, hidden, inputs, forward_batch) if self.drafter else None
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=self._prompt_logprobs(hidden, req_ids, inputs),
            failed=failed,
            draft_token_ids=drafts,
        )

    # ------------------------------------------------------------------ speculative decoding

    def _drafter_caches(self) -> list:
        return self.kv_caches[len(self.kv_caches) - self.drafter.num_entries :]

    def _propose(
        self,
        req_ids: list[str],
        sampled: list[list[int]],
        hidden: torch.Tensor,
        inputs: StepInputs,
        forward_batch: ForwardBatch,
    ) -> dict[str, list[int]]:
        """The drafter's drafts for every request that sampled this step (now decoding), for the next
        step; their q kept for its verification. Nothing while the batch is too large to speculate (the
        scheduler would drop them: `SpeculativeConfig.disable_by_batch_size`), so none are computed; the
        MTP still computes its K/V for the step's positions (every position the target computes)."""
        self.draft_probs = {}
        batch = self.input_batch
        caches = self._drafter_caches()
        mtp_out = None
        if isinstance(self.drafter, MtpDrafter):
            mtp_out = self.drafter.run_step(batch, inputs, hidden, forward_batch, caches)
        rows = [row for row, tokens in enumerate(sampled) if tokens]
        if not rows or batch.num_reqs > self.drafter.disable_by_batch_size:
            return {}
        if mtp_out is not None:
            drafts, probs = self.drafter.propose(batch, rows, inputs, mtp_out, caches, self.max_model_len)
        else:
            drafts, probs = self.drafter.propose(batch, rows, caches, self.max_model_len)
        self.draft_probs = {req_ids[row]: q for row, q in probs.items()}
        return {req_ids[row]: d for row, d in drafts.items() if d}

    def _draft_q(self, req_ids: list[str], drafts: list[list[int]]) -> list[torch.Tensor | None] | None:
        """The drafter's q of each request's scheduled drafts (a prefix of those it proposed: the
        scheduler cuts from the end); None without a drafter (token-only drafts: q one-hot)."""
        if self.drafter is None:
            return None
        out: list[torch.Tensor | None] = []
        for rid, d in zip(req_ids, drafts, strict=True):
            q = self.draft_probs.get(rid)
            out.append(None if q is None or not d else q[: len(d)])
        return out

    def _place_drafts(self, spec: dict[str, list[int]], req_ids: list[str]) -> list[list[int]] | None:
        """Write each request's draft tokens after its known ones (read as input ids like any token;
        overwritten by whatever is accepted). None when no request has drafts this step."""
        if not spec:
            return None
        batch = self.input_batch
        drafts = [spec.get(rid, []) for rid in req_ids]
        for row, d in enumerate(drafts):
            if d:
                start = int(batch.num_tokens[row])
                batch.token_ids[row, start : start + len(d)] = d
        return drafts

    def _verify_drafts(
        self,
        hidden: torch.Tensor,
        inputs: StepInputs,
        req_ids: list[str],
        drafts: list[list[int]],
        grammar_masks: dict[str, np.ndarray] | None,
        forward_batch: ForwardBatch,
    ) -> ModelRunnerOutput:
        """Score every draft position and the one after it in one LM-head call, keep the accepted drafts
        and one more token per request (`RejectionSampler`), and count the rejected positions out."""
        batch = self.input_batch
        n = inputs.num_reqs
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        seq_after = inputs.seq_lens
        sample_mask = seq_after >= batch.num_tokens[:n] + num_drafts
        drafts = [d if sample_mask[row] else [] for row, d in enumerate(drafts)]
        width = np.where(sample_mask, num_drafts + 1, 1)  # rows mid-prompt: one row, discarded below
        ends = inputs.query_end
        index = np.concatenate([np.arange(e - w, e) for e, w in zip(ends, width, strict=True)])
        rows = hidden[torch.from_numpy(index)]
        firsts = np.cumsum(width) - width  # each request's first logits row
        targets = None if grammar_masks else self._greedy_targets(rows, n)
        if targets is not None:
            tokens, logprobs, failed = accept_greedy(targets, firsts.tolist(), drafts), [None] * n, {}
        else:
            logits = self.model.compute_logits(rows)
            if grammar_masks:
                apply_grammar_masks(logits, *_draft_mask_rows(req_ids, firsts, width, grammar_masks))
            discard = np.flatnonzero(~sample_mask).tolist()
            q = self._draft_q(req_ids, drafts)
            tokens, logprobs, failed = self._spec_sample(logits, firsts, drafts, req_ids, discard, q)
        failed = self._failed_adapters(failed)
        sampled_lists: list[list[int]] = []
        out_logprobs: list[list[TokenLogprobs] | None] = []
        for row in range(n):
            if not sample_mask[row] or req_ids[row] in failed:
                sampled_lists.append([])
                out_logprobs.append(None)
                continue
            emitted = tokens[row]
            for tok in emitted:
                batch.append_token(row, tok)
            sampled_lists.append(emitted)
            out_logprobs.append(logprobs[row])
            seq_after[row] -= len(drafts[row]) + 1 - len(emitted)
        batch.num_computed_tokens[:n] = seq_after
        return self._output(hidden, req_ids, inputs, sampled_lists, out_logprobs, failed, forward_batch)

    def _spec_sample(
        self,
        logits: torch.Tensor,
        firsts: np.ndarray,
        drafts: list[list[int]],
        req_ids: list[str],
        discard: list[int],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None], dict[str, str]]:
        """Verify with the rejection sampler; if that fails, every draft counts as rejected and each
        request samples its first position alone through the plain path (which isolates a bad request)."""
        sampling = self.input_batch.sampling
        n = len(req_ids)
        metadata = sampling.make_spec_metadata(n, drafts)
        states = {row: g.get_state() for row, g in _row_generators(sampling, range(n)).items()}
        try:
            out = self.rejection_sampler(logits, metadata, drafts, draft_probs)
        except Exception:
            logger.exception("speculative verification failed; sampling without the drafts")
            for row, state in states.items():  # the draws are taken again, from where they were
                sampling.generators[row].set_state(state)
            plain = sampling.make_metadata(n, discard_rows=discard)
            one, one_lp, failed = self._sample(logits[torch.from_numpy(firsts)], plain, req_ids)
            return [[t] for t in one], [None if lp is None else [lp] for lp in one_lp], failed
        for row in discard:  # rows mid-prompt sampled nothing: their seeded generators must not advance
            if row in states:
                sampling.generators[row].set_state(states[row])
        return out.token_ids, out.logprobs, {}

    def _greedy_targets(self, rows: torch.Tensor, n: int) -> list[int] | None:
        """The argmax of every verified row, where the batch's requests all take the argmax whatever they
        have drafted (greedy, no logprobs, no logit-editing stage; bad words could begin inside the
        drafts, so none): what the rejection sampler would compare the drafts with, without its
        per-position metadata. None: verify through `RejectionSampler`."""
        sampling = self.input_batch.sampling
        if sampling.num_bad_words_rows:
            return None
        metadata = sampling.make_metadata(n)
        if metadata.logitsprocs is not None:
            return None  # the rejection sampler refuses them (they follow the batch's rows)
        if not _argmax_only(metadata):
            return None  # min_tokens: a row banning EOS now is in edits_logits; one that does not, later
        ids = self._head_argmax(rows)
        return ids if ids is not None else ops.greedy_ids(self.model.compute_logits(rows)).tolist()

    def _head_argmax(self, rows: torch.Tensor) -> list[int] | None:
        """Each row's argmax of the logits straight from the LM head, where the model can give it without
        them (`CausalLM.greedy_ids`); None: compute the logits."""
        greedy_ids = getattr(self.model, "greedy_ids", None)
        ids = greedy_ids(rows) if greedy_ids is not None else None
        return None if ids is None else ids.tolist()

    def _sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, req_ids: list[str]
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[str, str]]:
        """One token per row. Sampling is per request: if the batched call fails, each row is sampled
        alone (seeded generators rewound first, so their draws are what they would have been) and
        only the rows that fail by themselves fail, with their error; the forward's KV stays valid."""
        states = {row: gen.get_state() for row, gen in metadata.generators.items()}
        try:
            out = self.sampler(logits, metadata)
            return out.sampled_token_ids.tolist(), out.logprobs, {}
        except Exception:
            logger.exception("batched sampling failed; sampling each request alone to isolate the fault")
        for row, state in states.items():
            metadata.generators[row].set_state(state)
        tokens: list[int] = [0] * len(req_ids)
        logprobs: list[TokenLogprobs | None] = [None] * len(req_ids)
        failed: dict[str, str] = {}
        for row, req_id in enumerate(req_ids):
            try:
                out = self.sampler(logits[row : row + 1], metadata.select_row(row))
            except Exception as e:
                logger.exception("request %s failed in sampling; it is aborted, the batch goes on", req_id)
                failed[req_id] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            tokens[row] = int(out.sampled_token_ids[0])
            logprobs[row] = out.logprobs[0]
        return tokens, logprobs, failed

    def _copy_pages(self, scheduler_output: SchedulerOutput) -> None:
        """Copy-on-write of partial prefix-hit pages first, then recurrent state copies (the contract's
        order: every source is read before any write of the step)."""
        batch = self.input_batch
        if scheduler_output.prefix_page_copies:
            apply_prefix_page_copies(
                scheduler_output.prefix_page_copies, batch.block_ids, self.group_entries, self.kv_caches
            )
        if scheduler_output.mamba_state_copies:
            apply_state_copies(
                scheduler_output.mamba_state_copies, batch.block_ids, self.group_entries, self.kv_caches
            )

    def _group_metadata(
        self, g: int, spec: KVCacheSpec, inputs: StepInputs, verify: list[int] | None = None
    ) -> AttentionMetadata | RecurrentBatch:
        if isinstance(spec, MambaSpec):
            return self._recurrent_metadata(g, spec, inputs, verify)
        return self._attention_metadata(g, spec.block_size, inputs)

    def _recurrent_metadata(
        self, g: int, spec: MambaSpec, inputs: StepInputs, verify: list[int] | None = None
    ) -> RecurrentBatch:
        """The running state page of each request: column (n + k - 1) // B of its block list; rows in
        ``verify`` (verifying drafts) keep their state after every position for `_commit_recurrent`."""
        n, num_sched, num_computed = inputs.num_reqs, inputs.num_scheduled, inputs.num_computed
        table = self.input_batch.block_tables[g]
        if spec.cache_mode == "none":
            columns = np.zeros(n, dtype=np.int64)
        else:
            columns = np.maximum(num_computed + num_sched - 1, 0) // spec.block_size
        running = table.table[np.arange(n), columns].astype(np.int64)
        qsl = np.concatenate(([0], np.cumsum(num_sched)))
        if spec.cache_mode != "all":
            return build_recurrent_batch(qsl, num_computed, num_sched, running, verify_reqs=verify)
        # "all": also write the state at every block boundary crossed to that column's page.
        pages = boundary_pages(table.table[:n], num_computed, num_sched, spec.block_size)
        return build_recurrent_batch(
            qsl, num_computed, num_sched, running, pages, spec.block_size, verify_reqs=verify
        )

    def _commit_recurrent(self, group_metadata: list, sampled: list[list[int]]) -> None:
        """Hybrids after verification: each request's state after the tokens it kept (accepted drafts + 1,
        ``len(sampled[row])``) becomes its running state, selected from what the verify pass kept."""
        kept = [len(tokens) for tokens in sampled]
        for g, meta in enumerate(group_metadata):
            if isinstance(meta, RecurrentBatch) and meta.verify_reqs:
                spec = self.group_specs[g]
                table = self.input_batch.block_tables[g].table
                commit_verified(meta, kept, table, spec.block_size, spec.cache_mode)

    def _attention_metadata(self, g: int, block_size: int, inputs: StepInputs) -> AttentionMetadata:
        n = inputs.num_reqs
        table = self.input_batch.block_tables[g]
        width = max(int(table.num_blocks[:n].max()), 1)
        block_table = table.table[:n, :width]
        return make_attention_metadata(
            torch.from_numpy(block_table),
            inputs.num_scheduled.tolist(),
            inputs.seq_lens.tolist(),
            torch.from_numpy(slot_mapping(block_table, inputs.rows, inputs.positions, block_size)),
            block_size,
            self.page_epochs.epochs,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, req_ids: list[str], inputs: StepInputs
    ) -> dict[str, list[TokenLogprobs | None]]:
        """Logprobs of prompt tokens 1..P-1, for the prompt positions computed this step."""
        batch = self.input_batch
        out: dict[str, list[TokenLogprobs | None]] = {}
        for row, num_top in sorted(batch.prompt_logprobs.items()):
            if row >= inputs.num_reqs:
                continue
            n_prompt = int(batch.num_prompt_tokens[row])
            first = int(inputs.num_computed[row])
            # position p predicts token p+1; only positions < n_prompt - 1 score a prompt token
            last = min(first + int(inputs.num_scheduled[row]), n_prompt - 1)
            if last <= first:
                continue
            start = int(inputs.query_start[row])
            idx = torch.arange(start, start + last - first)
            logits = self.model.compute_logits(hidden[idx])
            targets = torch.from_numpy(batch.token_ids[row, first + 1 : last + 1].copy())
            scored = list(compute_prompt_logprobs(logits, targets, num_top))
            # the first prompt token has no logprob (nothing precedes it)
            out[req_ids[row]] = ([None] if first == 0 else []) + scored
        return out


def _argmax_only(metadata: SamplingMetadata) -> bool:
    """Whether the sampler would take each row's argmax of the logits as they are: every row greedy, no
    logprobs, no stage that edits a logit."""
    return metadata.all_greedy and not metadata.edits_logits and metadata.max_num_logprobs is None


def _row_generators(sampling, rows: Iterable[int]) -> dict[int, torch.Generator]:
    """The seeded generators of `rows` of the batch's sampling state."""
    return {row: g for row in rows if (g := sampling.generators[row]) is not None}


def _draft_mask_rows(
    req_ids: Sequence[str], firsts: np.ndarray, width: np.ndarray, masks: dict[str, np.ndarray]
) -> tuple[list[tuple[str, int] | None], dict[tuple[str, int], np.ndarray]]:
    """Each logits row of a verification step keyed (request, position), and each key's mask: a request
    with drafts has a mask row per position ([drafts + 1, words], structured/manager.draft_masks), one
    without a single row."""
    keys: list[tuple[str, int] | None] = [None] * int(width.sum())
    rows: dict[tuple[str, int], np.ndarray] = {}
    for row, rid in enumerate(req_ids):
        mask = masks.get(rid)
        if mask is None:
            continue
        per_position = mask if mask.ndim == 2 else mask[None]
        for j in range(int(width[row])):
            keys[int(firsts[row]) + j] = (rid, j)
            rows[rid, j] = per_position[min(j, len(per_position) - 1)]
    return keys, rows


def apply_grammar_masks(logits: torch.Tensor, req_ids: Sequence[Hashable | None], masks: dict) -> None:
    """Set to -inf, in place, every logit a request's grammar forbids (row r of ``logits`` is req_ids[r])."""
    rows = [i for i, rid in enumerate(req_ids) if rid in masks]
    if not rows:
        return
    words = torch.from_numpy(np.stack([masks[req_ids[i]] for i in rows]))
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), -1)[:, : logits.shape[1]].bool()
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
