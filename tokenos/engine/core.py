"""The engine core: the busy loop `schedule -> execute -> update_from_output`.

It owns the scheduler and the model runner and nothing slow: no tokenizing, no text.
`EngineCore` is used in-process by the offline `LLM` and inside the engine-core process
(`core_proc.py`) by the server; both speak `EngineCoreRequest` / `EngineCoreOutputs`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from tokenos.core.kv_cache.spec import (
    AttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
    get_kv_cache_config,
)
from tokenos.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenos.core.request import Request, RequestStatus
from tokenos.core.sched.scheduler import Scheduler
from tokenos.core.validation import check_prompt_tokens, check_sampling_for_model, check_sampling_values
from tokenos.engine.args import EngineArgs, model_name
from tokenos.reasoning import get_reasoning_parser
from tokenos.structured.backend import GrammarBackend, make_backend
from tokenos.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long an idle step waits for a grammar being compiled before it returns.
GRAMMAR_POLL_S = 0.002


def _kv_tokens(config: KVCacheConfig) -> int:
    """Tokens a pool holds for attention (pages divided among the attention groups)."""
    groups = config.kv_cache_groups
    attention = [g for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)] or groups
    block_size = attention[0].kv_cache_spec.block_size
    return (config.num_blocks - 1) * block_size // len(groups)


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        from tokenos.sample.logits_processor import load_logits_processors
        from tokenos.worker.model_runner import ModelRunner

        t0 = time.perf_counter()
        self.args = args
        model_config, scheduler_config, cache_config = args.create_configs()
        self.model_config = model_config
        # Custom logits processors: classes or "module:Class" (a bad one fails here, at start-up).
        self.logits_processors = load_logits_processors(args.logits_processors)
        speculative = args.speculative()
        self.model_runner = ModelRunner(
            model_config,
            cache_config,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
            logits_processors=self.logits_processors,
            scheduler_config=scheduler_config,
            lora_config=args.lora_config(),
            speculative_config=speculative,
        )
        self.loras = self.model_runner.lora
        layer_specs = self.model_runner.get_kv_cache_spec()
        self.kv_cache_config = get_kv_cache_config(
            layer_specs,
            available_memory_bytes=None if args.num_kv_blocks else args.resolved_kv_cache_memory_bytes,
            num_blocks=args.num_kv_blocks,
            max_model_len=model_config.max_model_len,
            mamba_checkpoint_interval=cache_config.mamba_checkpoint_interval,
        )
        self.model_runner.initialize_kv_cache(self.kv_cache_config)
        self._log_kv_dtype(cache_config.cache_dtype, layer_specs, model_config.max_model_len)
        if speculative is not None and self.logits_processors:
            raise ValueError(
                "speculative decoding with custom logits processors is not supported: they see one "
                "position per request per step. Drop speculative_config or the logits processors."
            )
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            self.kv_cache_config,
            model_config.max_model_len,
            speculative_config=speculative,
            max_loras=self.loras.config.max_loras if self.loras is not None else None,
        )
        if self.loras is not None:
            self.scheduler.on_request_freed = self._release_adapter
        # Structured output, built on the first request with a grammar (it loads the tokenizer).
        self.structured: StructuredOutputManager | None = None
        self._loaded_tokenizer: Any = None
        self._log_pool_layout(args.block_size)
        self.model_runner.check_batch_invariant()
        logger.info("%s", self.model_runner.describe_kernels())
        self.startup_s = time.perf_counter() - t0
        logger.info(
            "engine core ready in %.1fs: model %s, %d KV blocks (%d tokens)",
            self.startup_s,
            model_name(model_config),
            self.kv_cache_config.num_blocks,
            self.num_kv_tokens,
        )

    def _log_pool_layout(self, requested_block_size: int) -> None:
        """For hybrids: the unified page, the attention block size it forced, the pool's capacity."""
        groups = self.kv_cache_config.kv_cache_groups
        if not any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
            return
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        block_size = groups[0].kv_cache_spec.block_size
        max_len = self.model_config.max_model_len
        per_request = sum(-(-g.kv_cache_spec.max_memory_usage_bytes(max_len) // page) for g in groups)
        usable = self.kv_cache_config.num_blocks - 1
        logger.info(
            "hybrid KV pool: unified page %d bytes; attention block size %d tokens (asked %d); "
            "%d pages in %d groups = %d requests of max_model_len %d, %d attention tokens",
            page,
            block_size,
            requested_block_size,
            usable,
            len(groups),
            usable // per_request,
            max_len,
            self.num_kv_tokens,
        )

    def _log_kv_dtype(self, cache_dtype: str, layer_specs: dict, max_model_len: int) -> None:
        """A chosen ``--kv-cache-dtype`` and what it buys: the pool's tokens against bf16 pages in the same
        bytes (sized again with bf16 attention specs, so hybrids' unified pages are accounted for).
        Nothing for "auto": the pages are the model's dtype and the ready line gives the tokens."""
        if cache_dtype == "auto":
            return
        attention = [s for s in layer_specs.values() if isinstance(s, AttentionSpec)]
        if not attention or attention[0].dtype == "bfloat16":
            logger.info("KV cache %s: %d tokens", cache_dtype, self.num_kv_tokens)
            return
        bf16_specs = {
            name: dataclasses.replace(s, dtype="bfloat16") if isinstance(s, AttentionSpec) else s
            for name, s in layer_specs.items()
        }
        # Tokens per pool byte with these pages against bf16 ones (a fixed block count: valid even where
        # the same bytes would hold too few bf16 pages for one request).
        num_blocks = self.kv_cache_config.num_blocks
        bf16 = get_kv_cache_config(
            bf16_specs,
            available_memory_bytes=None,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            mamba_checkpoint_interval=self.model_runner.cache_config.mamba_checkpoint_interval,
        )

        def tokens_per_byte(config: KVCacheConfig) -> float:
            return _kv_tokens(config) / sum(t.size_bytes for t in config.kv_cache_tensors)

        ratio = f" ({tokens_per_byte(self.kv_cache_config) / tokens_per_byte(bf16):.1f}x bf16)"
        logger.info(
            "KV cache %s (%s pages): %d tokens%s", cache_dtype, attention[0].dtype, self.num_kv_tokens, ratio
        )

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the pool holds for attention (pages divided among the attention groups)."""
        return _kv_tokens(self.kv_cache_config)

    # ------------------------------------------------------------ requests

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; ValueError (and nothing queued) when it can never run: any client may reach
        the core, so it checks what its kernels must be able to represent (`tokenos.core.validation`)."""
        vocab_size = self.model_config.vocab_size
        check_prompt_tokens(req.prompt_token_ids, self.model_config.max_model_len, vocab_size)
        check_sampling_values(req.sampling_params)
        check_sampling_for_model(req.sampling_params, vocab_size, max_logprobs=vocab_size)
        if self.logits_processors:
            from tokenos.sample.logits_processor import validate_logits_processor_params

            validate_logits_processor_params(self.logits_processors, req.sampling_params)
        adapter = self._acquire_adapter(req.lora_name) if req.lora_name is not None else None
        request = Request.from_engine_core_request(req, adapter_id=adapter)
        spec = req.sampling_params.structured
        if spec is None:
            self.scheduler.add_request(request)
        else:  # scheduled once its grammar is compiled (off this loop)
            self._structured_manager().submit(request, spec)

    def _acquire_adapter(self, name: str) -> str:
        if self.loras is None:
            raise ValueError(
                f"the request asks for LoRA adapter {name!r}, but LoRA is off: start the engine with "
                "enable_lora=True (--enable-lora)."
            )
        return self.loras.acquire(name)

    def _release_adapter(self, request: Request) -> None:
        if self.loras is not None and request.adapter_id is not None:
            self.loras.release(request.adapter_id)

    def _structured_manager(self) -> StructuredOutputManager:
        if self.structured is None:
            markers = self._reasoning_markers if self.args.reasoning_parser else None
            self.structured = StructuredOutputManager(
                self._grammar_backend, self.model_config.vocab_size, reasoning_markers=markers
            )
        return self.structured

    def _tokenizer(self) -> Any:
        if self._loaded_tokenizer is None:
            from tokenos.engine.tokenizer import load_tokenizer

            self._loaded_tokenizer = load_tokenizer(self.args.tokenizer or self.args.model)
        return self._loaded_tokenizer

    def _reasoning_markers(self) -> tuple[list[int], list[int]]:
        parser = get_reasoning_parser(self.args.reasoning_parser)
        tokenizer = self._tokenizer()
        return (
            tokenizer.encode(parser.start, add_special_tokens=False),
            tokenizer.encode(parser.end, add_special_tokens=False),
        )

    def _grammar_backend(self) -> GrammarBackend:
        tokenizer = self._tokenizer()
        eos = list(self.model_config.eos_token_ids) or [tokenizer.eos_token_id]
        return make_backend(
            self.args.structured_outputs_backend,
            tokenizer.hf,
            self.model_config.vocab_size,
            [t for t in eos if t is not None],
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if self.structured is not None:
            pending = self.structured.abort(ids)
            for request in pending:
                self._release_adapter(request)
            pending_ids = {r.request_id for r in pending}
            ids = [rid for rid in ids if rid not in pending_ids]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        pending = self.structured is not None and self.structured.num_pending > 0
        return pending or self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------ the loop

    def step(self) -> EngineCoreOutputs:
        failed = self._admit_compiled() if self.structured is not None else []
        if not self.scheduler.has_unfinished_requests():
            if self.structured is not None and self.structured.num_pending:
                time.sleep(GRAMMAR_POLL_S)  # nothing to run until a grammar is ready
            return EngineCoreOutputs(outputs=failed, timestamp=time.monotonic(), stats=self.get_stats())
        scheduler_output = self.scheduler.schedule()
        masks = None
        if self.structured is not None:
            masks = self.structured.bitmasks(scheduler_output, self.scheduler.requests)
        runner_output = self.model_runner.execute_model(scheduler_output, grammar_masks=masks)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs=failed + outputs, timestamp=time.monotonic(), stats=self.get_stats())

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is now compiled join the scheduler; those whose grammar failed end,
        with the error."""
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, _ in failed:
            self._release_adapter(request)
        return [
            EngineCoreOutput(req.request_id, [], finish_reason=int(FinishReason.ABORT), error=error)
            for req, error in failed
        ]

    # ------------------------------------------------------------ utilities

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def add_lora(self, name: str, path: str) -> dict:
        """Load the PEFT adapter in ``path`` as ``name`` (checked against the model); its description.
        ValueError saying what is wrong (LoRA off, a bad folder, a mismatched base model, a rank too big)."""
        if self.loras is None:
            raise ValueError("LoRA is off: start the engine with enable_lora=True (--enable-lora).")
        return self.loras.register(name, path).as_dict()

    def remove_lora(self, name: str) -> bool:
        """Forget the adapter ``name`` (requests already running under it finish with it)."""
        return self.loras is not None and self.loras.unregister(name)

    def list_loras(self) -> list[dict]:
        return [info.as_dict() for info in self.loras.list()] if self.loras is not None else []

    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        pending = self.structured.num_pending if self.structured is not None else 0
        if pending:  # waiting for their grammar to compile: waiting, as vLLM counts them, not for capacity
            stats["num_waiting"] += pending
            stats["num_waiting_deferred"] = stats.get("num_waiting_deferred", 0) + pending
        return stats

    def get_kv_groups(self) -> list[dict]:
        """Per KV-cache group: its kind (full_attention, sliding_window, or mamba: recurrent state), the
        pages its requests hold now (for a metrics scrape: it walks every request's blocks) and the pages
        prefix-cache hits have taken from it so far."""
        kv = self.scheduler.kv_cache_manager
        pages = kv.pages_by_group()
        return [
            {
                "group": i,
                "kind": _group_kind(g.kv_cache_spec),
                "pages": pages[i],
                "hit_pages": kv.hit_pages_by_group[i],
            }
            for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
        ]

    def get_model_info(self) -> dict:
        return {
            "model": model_name(self.model_config),
            "max_model_len": self.model_config.max_model_len,
            "num_kv_blocks": self.kv_cache_config.num_blocks,
            "kv_pool_tokens": self.num_kv_tokens,
            "vocab_size": self.model_config.vocab_size,
        }


def _group_kind(spec: Any) -> str:
    if isinstance(spec, MambaSpec):
        return "mamba"
    return "sliding_window" if isinstance(spec, SlidingWindowSpec) else "full_attention"
