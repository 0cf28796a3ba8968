"""`tokenos bench families`: each native model family against a Llama of the same size, and the KV
memory a sliding-window family saves.

Every family is a random-weight checkpoint written on the fly from its transformers config at one shared
shape (``SHAPE``: hidden size, depth, heads, MLP width, vocabulary), so the figures compare the code
paths, not the models: output tokens/s of one synthetic batch (greedy, EOS ignored), and its ratio to the
Llama's. The Llama runs twice more, forced onto the transformers backend (``--model-impl transformers``)
and natively again at the end, so the spread between its two native runs says how noisy the machine is.

The KV part needs no forward pass: the bytes one request holds at a context length are the sum over the
model's attention layers of their cache spec's ``max_memory_usage_bytes`` at one token per step (a
sliding-window layer keeps the window plus a block, a full layer every token), for Gemma 3 with Gemma 3
1B's window and 5:1 pattern against the same-size Llama.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

# One shape for every family: SmolLM2-135M's width and head layout, 8 layers, a 4K vocabulary.
SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=32768,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=True,
)
# Gemma 3 1B's local attention: a window of 512 tokens on five layers of every six.
GEMMA3_WINDOW = dict(sliding_window=512, sliding_window_pattern=6)
_MLA = dict(
    num_key_value_heads=9,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    head_dim=32,  # transformers' rotary reads head_dim: the rope dims
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    n_shared_experts=1,
    first_k_dense_replace=1,
    rope_interleave=True,
)
# family -> (transformers config class, fields over SHAPE); MoE: 8 experts, top 2, of a quarter width.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5}),
    "gemma2": ("Gemma2Config", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
    "gemma3": ("Gemma3TextConfig", {**GEMMA3_WINDOW, "query_pre_attn_scalar": 64}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 384,
            "shared_expert_intermediate_size": 1536,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384, "norm_topk_prob": True},
    ),
    # MLA at the shared width: 9 heads of 64 (+ 32 rope dims) over a 128-value latent; 8 routed experts
    # (top 2) and one shared, of a quarter width, after one dense layer.
    "deepseek_v2": ("DeepseekV2Config", {**_MLA, "q_lora_rank": None, "topk_method": "greedy"}),
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, "q_lora_rank": 192, "n_group": 2, "topk_group": 1}),
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 384,
            "sliding_window": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


def write_checkpoint(family: str, folder: str) -> str:
    import torch
    import transformers

    cls, fields = FAMILIES[family]
    config = getattr(transformers, cls)(**{**SHAPE, **fields})
    if family == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def throughput(folder: str, args: argparse.Namespace, **engine) -> dict:
    """Output tokens/s of ``args.num_prompts`` random prompts after a warm-up of a few."""
    import random

    from tokenos import LLM, SamplingParams

    llm = LLM(
        folder,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        max_model_len=args.input_len + args.output_len,
        skip_tokenizer_init=True,
        **engine,
    )
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm, outputs
    gc.collect()  # this engine's KV pool and weights go before the next family's are allocated
    return {"output_tok_s": round(tokens / wall, 1), "wall_s": round(wall, 2)}


def kv_bytes_per_request(folder: str, contexts: list[int], dtype: str) -> dict[int, int]:
    """Per context length: the KV-cache bytes one decoding request of that many tokens holds (one new
    token per step), over all layers."""
    from tokenos.config import CacheConfig
    from tokenos.models import build_model, load_model_config

    config = load_model_config(folder, dtype=dtype)
    specs = build_model(config).get_kv_cache_spec(CacheConfig()).values()
    return {n: sum(spec.max_memory_usage_bytes(n, 1) for spec in specs) for n in contexts}


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        needed = dict.fromkeys(["llama", "gemma3", *args.families])
        folders = {f: write_checkpoint(f, f"{root}/{f}") for f in needed}
        runs = [("llama", {})] + [(f, {}) for f in args.families if f != "llama"]
        runs += [("llama", {"model_impl": "transformers"}), ("llama", {})]
        base = None
        for family, engine in runs:
            row = {"family": family, "impl": engine.get("model_impl", "tokenos"), "dtype": args.dtype}
            row.update(throughput(folders[family], args, **engine))
            base = base or row["output_tok_s"]
            row["vs_llama"] = round(row["output_tok_s"] / base, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
        for family in ("gemma3", "llama"):
            kv = kv_bytes_per_request(folders[family], args.contexts, args.dtype)
            row = {"family": family, "kv_bytes_per_request": {str(n): b for n, b in kv.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenos bench families", description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=[f for f in FAMILIES if f != "llama"])
    # 32 x 128 tokens: runs of a few seconds each (a second's run swings +-20% on a shared VM).
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    args = parser.parse_args(argv)
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    run(args)
    return 0
