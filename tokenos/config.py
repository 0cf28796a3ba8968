"""Configuration dataclasses: every knob of the scheduler and the KV cache, validated in one place.

Each field maps to exactly one CLI flag. Validation lives in `__post_init__` and raises a
ValueError that names the bad value and says what to change, so a bad setting is rejected at
start-up instead of surfacing as a hang or a wrong answer later.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")
HASH_ALGOS = ("sha256", "xxhash", "blake2b")
# Weight quantization (--quantization): see tokenos.models.config.resolve_quantization.
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4", "gptq", "awq")
MAMBA_CACHE_MODES = ("align", "none", "all")
# --model-impl (vLLM's flag; "vllm" is its name for native code): tokenos.models.registry.resolve_model_impl.
MODEL_IMPL_CHOICES = ("auto", "tokenos", "vllm", "transformers")
# --kv-cache-dtype values (vLLM's names) -> the canonical dtype name KV-cache specs carry; "auto" is
# the model's dtype (tokenos.platform.kv_cache_dtype_name). fp8 is vLLM's alias of fp8_e4m3 (OCP e4m3fn:
# 4 exponent bits, 3 mantissa bits, finite range +-448, no infinities). int8: symmetric integers in
# [-127, 127] times a per-layer scale calibrated from the first real forward (tokenos.layers.attention).
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "bfloat16": "bfloat16",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "int8": "int8",
}
KV_CACHE_DTYPE_CHOICES = tuple(KV_CACHE_DTYPES)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


@dataclass
class SchedulerConfig:
    """How much work one engine step may contain and in which order requests are served."""

    # Token budget of one step: prompt chunks and decode tokens of all requests together.
    max_num_batched_tokens: int = 2048
    # Concurrency cap: requests in the running set.
    max_num_seqs: int = 256
    # Optional copy of the model's context length (the Scheduler also takes it directly).
    max_model_len: int | None = None
    # Split prompts across steps when the budget runs out (off: a prompt runs in one step).
    enable_chunked_prefill: bool = True
    # A prompt chunk longer than this is cut (0: off), so long prompts cannot starve decodes.
    long_prefill_token_threshold: int = 0
    # "fcfs" (arrival order) or "priority" (lower `priority` value first, then arrival).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                    f"max_model_len ({self.max_model_len}) with chunked prefill off: a long prompt "
                    "could never be scheduled. Enable chunked prefill or raise max_num_batched_tokens."
                )
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be an integer >= 0 (0 turns it off), "
                f"got {self.long_prefill_token_threshold!r}."
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}.")


@dataclass
class CacheConfig:
    """The KV-cache pool and prefix caching."""

    # Tokens per attention page as requested by the user; hybrid models may raise it (see
    # tokenos.core.kv_cache.spec) so that one page also holds a recurrent state.
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Block-hash function: sha256 (default, collision-safe), xxhash (xxh3_128, fast), blake2b.
    hash_algo: str = "sha256"
    # Recurrent-state checkpointing for models with Mamba-like layers (see MambaSpec).
    mamba_cache_mode: str = "align"
    # Recurrent checkpoint interval in tokens, independent of the attention page size (None: the
    # attention page size, vLLM's behaviour). Must divide the (raised) attention block size or be
    # a multiple of it. Use with mamba_cache_mode "all" to checkpoint every interval of a prompt;
    # a hit between attention page boundaries copies the partial page (copy-on-write).
    mamba_checkpoint_interval: int | None = None
    # Also checkpoint the exact state where a request ends (finished, aborted or preempted between
    # steps: prompt + answer so far), so the next turn of a chat resumes from the whole previous
    # turn. It costs no memory: the request's last running page is published instead of freed.
    mamba_checkpoint_at_end: bool = True
    # The dtype of attention pages (vLLM's --kv-cache-dtype): "auto" (the model's), "bfloat16",
    # "float32", "fp8" / "fp8_e4m3" or "int8" (one byte per value, about twice the tokens of bf16).
    # Recurrent states of hybrid models keep their own dtype whatever this says.
    cache_dtype: str = "auto"
    # vLLM's --calculate-kv-scales: fp8 pages take per-layer scales measured on the first real forward
    # instead of 1.0. int8 pages always do (a scale of 1.0 would round every value to an integer).
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.cache_dtype!r}."
            )
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}.")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}.")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got {self.mamba_cache_mode!r}."
            )
        if self.mamba_checkpoint_interval is not None:
            _positive_int("mamba_checkpoint_interval", self.mamba_checkpoint_interval)
        if not isinstance(self.mamba_checkpoint_at_end, bool):
            raise ValueError(f"mamba_checkpoint_at_end must be a bool, got {self.mamba_checkpoint_at_end!r}.")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora family): how many adapters one step may mix, their
    largest rank, and how many idle adapters stay loaded in memory."""

    # Distinct adapters in one step's batch; requests for others wait (head of line, never skipped).
    max_loras: int = 1
    # The largest rank an adapter may have; a bigger one is refused when it is loaded.
    max_lora_rank: int = 16
    # Adapters kept loaded while no live request uses them (least recently used leave first; a
    # request for one reloads it from its folder). None: max_loras.
    max_cpu_loras: int | None = None
    # When one adapter has every token of a run of steps, its dense linears run from copies with it
    # merged in (W + B A: the base model's speed, one adapter's copies of those weights in memory).
    merge_single_adapter: bool = True

    def __post_init__(self) -> None:
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})."
            )
