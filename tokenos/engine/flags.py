"""Every command-line flag in one table: the engine's (one `EngineArgs` field each, so `LLM(...)` takes
the same names as keyword arguments), the server's, and the vLLM flags tokenos accepts without a meaning
here or refuses because they would change results.

`add_flags(parser, flags)` builds argparse options from the table; `markdown_table()` renders the README's
flag table from it (a test keeps the README equal to it), so `--help`, `LLM(...)` and the README cannot
drift. Names are vLLM's; like vLLM's parser, ``--max_model_len`` means ``--max-model-len``, and sizes take
vLLM's suffixes (``2k`` = 2000, ``2K`` = 2048, memory as ``4GiB``). A vLLM flag with no meaning on this
engine (``--gpu-memory-utilization``, ``--enforce-eager``, ...) is accepted with one warning line; one that
would change what a request gets (``--quantization``, ``--speculative-config``, ...) is refused with the
reason, never silently ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenos.config import HASH_ALGOS, KV_CACHE_DTYPE_CHOICES, MODEL_IMPL_CHOICES, QUANTIZATION_CHOICES

logger = logging.getLogger("tokenos.flags")

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(value: str) -> int:
    """vLLM's human-readable integers: ``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {value!r} (sizes like 2k or 4K)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"no decimals with binary suffixes: did you mean {value.lower()}?")
    return int(number) * _BINARY[suffix]


_MEMORY_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_MEMORY_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30}
_MEMORY_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def memory_bytes(value: str) -> int:
    """A memory size: bytes, or with a unit (``4GiB``, ``512MiB``, ``8G``; vLLM's ``4K`` style too)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in _MEMORY_UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {value!r} (for example 4GiB or 512MiB)")
    number, unit = match.groups()
    if unit in _BINARY:  # vLLM's human_readable_int: 4K = 4096, 4G = 4 GiB
        return int(float(number)) * _BINARY[unit]
    return int(float(number) * _MEMORY_UNITS[unit.lower()])


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


def json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's CORS flags: '["*"]')."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError("expected a JSON list of strings, for example '[\"*\"]'")
    return parsed


@dataclass(frozen=True)
class Flag:
    """One option: its names (vLLM's first), where its value goes, and argparse's settings."""

    names: tuple[str, ...]
    dest: str
    help: str
    type: Callable[[str], Any] | None = None
    action: Any = None
    choices: Sequence[str] | None = None
    nargs: str | None = None
    default: Any = None  # None: the EngineArgs default (filled in by engine_kwargs' absence)
    metavar: str | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        kwargs: dict[str, Any] = {"dest": self.dest, "help": self.help, "default": self.default}
        for name in ("type", "action", "choices", "nargs", "metavar"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        parser.add_argument(*self.names, **kwargs)


BOOL = argparse.BooleanOptionalAction

# The engine's flags: dest is the EngineArgs field (tests check that every field has exactly one).
ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag(("--model",), "model", "HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"),
    Flag(("--tokenizer",), "tokenizer", "a tokenizer folder other than the model's"),
    Flag(
        ("--skip-tokenizer-init",),
        "skip_tokenizer_init",
        "no tokenizer: token-id prompts in, token ids out",
        action="store_true",
    ),
    Flag(
        ("--served-model-name",),
        "served_model_name",
        "the names clients use for the model (the first is the one responses carry); default: MODEL as given",
        nargs="+",
    ),
    Flag(("--dtype",), "dtype", "auto, bfloat16, float16 or float32 (auto: bfloat16 where the CPU has it)"),
    Flag(
        ("--quantization", "-q"),
        "quantization",
        "weights: auto (a GGUF's Q8_0/Q4_0/Q4_1 blocks, a GPTQ or AWQ int4 checkpoint's groups stay"
        " quantized), none (all dense), int8 or int4 (weight-only, quantized at load), gptq or awq (the"
        " checkpoint's own, named)",
        choices=QUANTIZATION_CHOICES,
    ),
    Flag(
        ("--model-impl",),
        "model_impl",
        "model code: auto (native where tokenos has it, else transformers), tokenos (alias vllm), or"
        " transformers (any causal LM whose attention goes through transformers' AttentionInterface)",
        choices=MODEL_IMPL_CHOICES,
    ),
    Flag(
        ("--max-model-len",),
        "max_model_len",
        "context length (2k, 4K, ...; default: the model's)",
        type=human_int,
    ),
    Flag(("--max-num-seqs",), "max_num_seqs", "requests running at once (128)", type=human_int),
    Flag(
        ("--max-num-batched-tokens",),
        "max_num_batched_tokens",
        "the token budget of one step (2048)",
        type=human_int,
    ),
    Flag(("--block-size",), "block_size", "tokens per KV-cache block (16)", type=int),
    Flag(("--enable-prefix-caching",), "enable_prefix_caching", "automatic prefix caching (on)", action=BOOL),
    Flag(
        ("--prefix-caching-hash-algo",),
        "prefix_caching_hash_algo",
        "the block hash (sha256)",
        choices=HASH_ALGOS,
    ),
    Flag(
        ("--kv-cache-dtype",),
        "kv_cache_dtype",
        "attention KV pages: auto (the model's dtype), bfloat16, float32, fp8 / fp8_e4m3 (float8 e4m3, scale"
        " 1.0) or int8 (per-layer scales from the first forward): 1-byte values hold about twice the tokens"
        " of bf16 in the same memory",
        choices=KV_CACHE_DTYPE_CHOICES,
    ),
    Flag(
        ("--calculate-kv-scales",),
        "calculate_kv_scales",
        "fp8 KV pages: per-layer K/V scales measured on the first forward instead of 1.0 (off; int8"
        " pages always calibrate)",
        action=BOOL,
    ),
    Flag(
        ("--kv-cache-memory-bytes", "--kv-cache-memory"),
        "kv_cache_memory_bytes",
        "the KV pool's memory (4GiB, 512MiB, bytes; default: VLLM_CPU_KVCACHE_SPACE GiB if set, else a "
        "quarter of free RAM up to 4 GiB)",
        type=memory_bytes,
    ),
    Flag(
        ("--num-kv-blocks", "--num-gpu-blocks-override"),
        "num_kv_blocks",
        "the KV pool's size in blocks (overrides the memory)",
        type=int,
    ),
    Flag(
        ("--long-prefill-token-threshold",),
        "long_prefill_token_threshold",
        "chunk prefills longer than this (0: off)",
        type=int,
    ),
    Flag(("--scheduling-policy",), "scheduling_policy", "fcfs or priority", choices=("fcfs", "priority")),
    Flag(("--seed",), "seed", "the engine's seed (0)", type=int),
    Flag(
        ("--chat-template",),
        "chat_template",
        "a Jinja chat template, a file holding one, or a shipped one by name (chatml_tools: ChatML with "
        "tools in the hermes format, for models whose own template has none)",
    ),
    Flag(
        ("--generation-config",),
        "generation_config",
        "request defaults from the model's generation_config.json: auto (the model's), vllm (none) or a "
        "folder holding one",
    ),
    Flag(
        ("--override-generation-config",),
        "override_generation_config",
        'request defaults over the generation config, as JSON ({"temperature": 0.5})',
        type=json_object,
    ),
    Flag(("--max-logprobs",), "max_logprobs", "the most logprobs a request may ask for (20)", type=int),
    Flag(
        ("--logits-processors",),
        "logits_processors",
        "custom logits processors (module:Class, vLLM V1's interface), enabled per request by extra_args",
        nargs="+",
    ),
    Flag(
        ("--speculative-config",),
        "speculative_config",
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4} (methods ngram, suffix, draft_model with "model": a drafter of the same '
        "tokenizer, mtp: the checkpoint's own MTP layer (Qwen3-Next, DeepSeek V3); ngram, suffix and mtp on "
        "dense and hybrid models, draft_model on dense ones)",
        type=json_object,
    ),
    Flag(
        ("--enable-lora",),
        "enable_lora",
        "serve LoRA adapters (PEFT folders; --lora-modules, or POST /v1/load_lora_adapter)",
        action="store_true",
    ),
    Flag(("--max-loras",), "max_loras", "LoRA: the most distinct adapters in one batch (1)", type=int),
    Flag(("--max-lora-rank",), "max_lora_rank", "LoRA: the largest adapter rank served (16)", type=int),
    Flag(
        ("--max-cpu-loras",),
        "max_cpu_loras",
        "LoRA: idle adapters kept loaded, least recently used evicted (--max-loras)",
        type=int,
    ),
    Flag(
        ("--merge-single-lora",),
        "merge_single_lora",
        "LoRA: an adapter alone in the batch for 8 steps runs merged into the dense weights, at the "
        "base model's speed, with one adapter's merged copies of them in memory (on)",
        action=BOOL,
    ),
    Flag(
        ("--reasoning-parser",),
        "reasoning_parser",
        "reasoning models: deepseek_r1 or qwen3 (thinking as reasoning_content; grammars after it)",
        choices=("deepseek_r1", "qwen3"),
    ),
    Flag(
        ("--structured-outputs-backend", "--guided-decoding-backend"),
        "structured_outputs_backend",
        "the grammar backend: auto / guidance (llguidance) or xgrammar",
        choices=("auto", "guidance", "llguidance", "xgrammar"),
    ),
    Flag(
        ("--max-waiting-requests",),
        "max_waiting_requests",
        "serving: requests that may wait beyond --max-num-seqs; more are refused with 429 (1024)",
        type=int,
    ),
    Flag(
        ("--disable-log-stats",),
        "disable_log_stats",
        "serving: no periodic stats line",
        action="store_true",
    ),
    Flag(
        ("--mamba-cache-mode",),
        "mamba_cache_mode",
        "hybrid models: which recurrent-state checkpoints to keep",
        choices=("align", "all", "none"),
    ),
    Flag(
        ("--mamba-checkpoint-interval",),
        "mamba_checkpoint_interval",
        "hybrid models: checkpoint the recurrent state every N tokens (finer than a page)",
        type=int,
    ),
    Flag(
        ("--mamba-checkpoint-at-end",),
        "mamba_checkpoint_at_end",
        "hybrid models: publish the exact state at the end of each finished request (on)",
        action=BOOL,
    ),
)


@dataclass(frozen=True)
class VllmFlag:
    """A vLLM flag without a tokenos meaning: accepted (with one warning) when ``harmless(value)``,
    refused otherwise with ``why``."""

    names: tuple[str, ...]
    why: str
    harmless: Callable[[Any], bool] = field(default=lambda value: True)
    takes_value: bool = True

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: str(value).lower() in {str(v).lower() for v in values}


def _never(value: Any) -> bool:
    return False


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--gpu-memory-utilization",), "no GPU: size the KV pool with --kv-cache-memory"),
    VllmFlag(("--enforce-eager",), "tokenos runs eagerly; nothing is captured", takes_value=False),
    VllmFlag(("--trust-remote-code",), "tokenos runs only its own model code", takes_value=False),
    VllmFlag(
        ("--disable-log-requests",), "requests are not logged unless --enable-log-requests", takes_value=False
    ),
    VllmFlag(("--disable-custom-all-reduce",), "one process, no all-reduce", takes_value=False),
    VllmFlag(("--enable-chunked-prefill",), "chunked prefill is always on", takes_value=False),
    VllmFlag(("--swap-space",), "preemption recomputes; nothing is swapped"),
    VllmFlag(("--max-seq-len-to-capture",), "no graphs are captured"),
    VllmFlag(("--cuda-graph-sizes",), "no graphs are captured"),
    VllmFlag(("--compilation-config", "-O"), "tokenos does not compile the model"),
    VllmFlag(("--distributed-executor-backend",), "one worker in the engine-core process"),
    VllmFlag(("--worker-multiproc-method",), "one worker in the engine-core process"),
    VllmFlag(
        ("--disable-frontend-multiprocessing",),
        "the engine core is always its own process",
        takes_value=False,
    ),
    VllmFlag(("--async-scheduling",), "the scheduler runs between steps", takes_value=False),
    VllmFlag(("--download-dir",), "nothing is downloaded: MODEL is a local folder or file"),
    VllmFlag(("--device",), "the CPU is the device", harmless=_is("cpu", "auto")),
    VllmFlag(("--load-format",), "weights load from safetensors or GGUF as found", harmless=_is("auto")),
    VllmFlag(
        ("--tensor-parallel-size", "-tp"), "one CPU process: no tensor parallelism yet", harmless=_is(1)
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"), "one CPU process: no pipeline parallelism yet", harmless=_is(1)
    ),
    VllmFlag(("--data-parallel-size", "-dp"), "one engine: no data parallelism yet", harmless=_is(1)),
    VllmFlag(("--hf-overrides",), "it would change the model's config", harmless=_never),
    VllmFlag(("--rope-scaling",), "it would change the model's positions", harmless=_never),
    VllmFlag(("--tokenizer-mode",), "Hugging Face tokenizers only", harmless=_is("auto", "hf")),
    VllmFlag(("--revision",), "nothing is downloaded: no revisions", harmless=_never),
)


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for flag in flags:
        flag.add_to(parser)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    for flag in VLLM_FLAGS:
        if flag.takes_value:
            parser.add_argument(*flag.names, dest=flag.dest, default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(
                *flag.names, dest=flag.dest, action="store_true", default=None, help=argparse.SUPPRESS
            )


def check_vllm_flags(args: argparse.Namespace, prog: str) -> None:
    """Warn once per given vLLM flag that means nothing here; SystemExit for one that would change
    results."""
    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if not flag.harmless(value):
            given = f"{flag.names[0]} {value}" if flag.takes_value else flag.names[0]
            raise SystemExit(f"{prog}: {given} is refused: {flag.why}.")
        logger.warning("%s is accepted and has no effect here: %s", flag.names[0], flag.why)


def underscores_to_dashes(argv: Sequence[str]) -> list[str]:
    """vLLM's parser takes ``--max_model_len`` for ``--max-model-len``; so does ours."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse as vLLM's parser would (underscores for dashes), then check the vLLM-only flags."""
    import sys

    args = parser.parse_args(underscores_to_dashes(sys.argv[1:] if argv is None else argv))
    check_vllm_flags(args, parser.prog)
    return args


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, and vLLM's flags that tokenos accepts or refuses by name."""
    add_flags(parser, ENGINE_FLAGS)
    add_vllm_flags(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineArgs keyword arguments the parsed flags give (unset flags keep EngineArgs' defaults)."""
    from tokenos.engine.args import EngineArgs

    names = set(EngineArgs.field_names()) - {"model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def markdown_table(server_flags: Sequence[Flag] = ()) -> str:
    """The README's flag table: present (engine, server), accepted with a warning, refused."""
    rows = ["| flag | status | meaning |", "|---|---|---|"]
    for flag in (*ENGINE_FLAGS, *server_flags):
        rows.append(f"| `{' / '.join(flag.names)}` | present | {flag.help} |")
    for flag in VLLM_FLAGS:
        if flag.harmless is _never:
            status = "refused"
        elif flag.harmless(None) or flag.takes_value is False:
            status = "accepted with a warning"
        else:
            status = "accepted with a warning at vLLM's default; otherwise refused"
        rows.append(f"| `{' / '.join(flag.names)}` | {status} | {flag.why} |")
    return "\n".join(rows) + "\n"
