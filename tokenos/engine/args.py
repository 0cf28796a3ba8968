"""Every user-facing engine setting, one field each (the CLI flags, `tokenos.engine.flags`, and the
`LLM(...)` kwargs map here).

`EngineArgs` is what users write; `create_configs()` resolves it against the model into the
typed configs each layer consumes (model, scheduler, cache), validating in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields


def _default_kv_cache_memory_bytes() -> int:
    """A quarter of the RAM that is free now, capped at 4 GiB (CPU: the pool is host memory)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        free = info.get("MemAvailable", 8 << 30)
    except OSError:
        free = 8 << 30
    return int(min(free // 4, 4 << 30))


@dataclass
class EngineArgs:
    model: str | None = None  # HF folder or .gguf file; None: the embedded SmolLM2
    tokenizer: str | None = None  # defaults to the model's
    skip_tokenizer_init: bool = (
        False  # token-id prompts only, no text out (benchmarks, tokenizer-less checkpoints)
    )
    served_model_name: str | list[str] | None = None  # the names clients use (the first is answered with)
    dtype: str = "auto"
    # Weights: None / "auto" (the checkpoint's own: GGUF blocks stay quantized), "none", "int8", "int4".
    quantization: str | None = None
    # Model code: "auto" (native where tokenos has it, else transformers), "tokenos" / "vllm", "transformers".
    model_impl: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    mamba_cache_mode: str = (
        "align"  # recurrent checkpoints: "align" (running + previous page), "all" (every interval), "none"
    )
    mamba_checkpoint_interval: int | None = None  # recurrent checkpoint interval (None: page size)
    mamba_checkpoint_at_end: bool = True  # checkpoint the exact end of every finished request
    kv_cache_memory_bytes: int | None = None
    # Attention pages: "auto" (the model's dtype), "bfloat16", "float32", "fp8" / "fp8_e4m3" (float8),
    # "int8" (scales calibrated on the first real forward).
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8 pages: calibrate per-layer scales too (int8 always does)
    num_kv_blocks: int | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    chat_template: str | None = None
    # Reasoning models: the parser naming their thinking markers (tokenos.reasoning); structured output
    # then constrains only the answer, and the chat server returns the thinking as reasoning_content.
    reasoning_parser: str | None = None
    # The grammar backend of structured output: "auto" / "guidance" (llguidance) or "xgrammar".
    structured_outputs_backend: str = "auto"
    # Serving: requests (samples) that may wait beyond the max_num_seqs running; more get 429.
    max_waiting_requests: int = 1024
    # Request defaults: "auto" takes the model's generation_config.json (temperature, top_p, ...), "vllm"
    # none, or a folder holding one; override_generation_config goes over it.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    max_logprobs: int = 20  # the most top-n logprobs (and prompt logprobs) a request may ask for
    disable_log_stats: bool = False  # serving: no periodic stats line
    # Custom logits processors (vLLM V1's interface, tokenos.sample.logits_processor): classes, or
    # "package.module:ClassName" strings (--logits-processors); requests enable them through extra_args.
    logits_processors: list[str | type] | None = None
    # Speculative decoding, vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4, ...}) or its
    # JSON text; None: off. See tokenos.core.spec_decode.
    speculative_config: dict | str | None = None
    # Multi-LoRA (tokenos.lora): serve PEFT adapters over the base model, at most max_loras distinct ones
    # per step, each of rank <= max_lora_rank; max_cpu_loras idle ones stay loaded (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # One adapter alone in the batch for a while runs merged into the dense weights (LoRAConfig).
    merge_single_lora: bool = True

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_configs(self):
        """(ModelConfig, SchedulerConfig, CacheConfig) for this model; ValueError on a bad setting."""
        from tokenos.config import CacheConfig, SchedulerConfig
        from tokenos.models.config import load_model_config
        from tokenos.reasoning import get_reasoning_parser
        from tokenos.structured.backend import check_backend_available

        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # ValueError naming the known parsers
        check_backend_available(self.structured_outputs_backend)
        self.speculative()  # ValueError on a bad or unbuilt speculative_config, before loading anything
        self.lora_config()
        model_config = load_model_config(
            self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            quantization=self.quantization,
            model_impl=self.model_impl,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(self.max_num_batched_tokens, 1),
            max_model_len=model_config.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_algo=self.prefix_caching_hash_algo,
            mamba_cache_mode=self.mamba_cache_mode,
            mamba_checkpoint_interval=self.mamba_checkpoint_interval,
            mamba_checkpoint_at_end=self.mamba_checkpoint_at_end,
            cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )
        return model_config, scheduler_config, cache_config

    def lora_config(self):
        """The checked LoRAConfig, or None when LoRA serving is off."""
        from tokenos.config import LoRAConfig

        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            merge_single_adapter=self.merge_single_lora,
        )

    def speculative(self):
        """The checked SpeculativeConfig, or None when speculative decoding is off."""
        from tokenos.core.spec_decode import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def resolved_kv_cache_memory_bytes(self) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        env = os.environ.get("TOKENOS_KV_CACHE_MEMORY_BYTES")
        if env:
            return int(env)
        vllm_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")  # vLLM CPU's knob, in GiB
        if vllm_space and float(vllm_space) > 0:
            return int(float(vllm_space) * 2**30)
        return _default_kv_cache_memory_bytes()


def model_name(model_config) -> str:
    """The name a model is served and logged under: its file or folder name."""
    path = model_config.model_path.rstrip("/")
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
