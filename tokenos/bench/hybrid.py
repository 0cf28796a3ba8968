"""`tokenos bench hybrid`: a tiny hybrid (attention + Mamba2) against a same-size pure-attention
model, at growing context: decode tokens/s, KV-cache memory per request, time to first token
with and without a prefix hit on a shared prefix, and n > 1 sampling with forks (the prompt
computed once, the state copied to each sample) against n independent copies of the prompt.

Both models are random-weight checkpoints written on the fly with transformers' configs
(Bamba for the hybrid, Llama for attention), same hidden size and depth. The recurrent state
is a fixed number of bytes per request, so the hybrid's memory per request stays nearly flat
while the attention model's grows with the context.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

HIDDEN, LAYERS, HEADS = 256, 8, 4


def write_checkpoints(root: str, max_len: int) -> dict[str, str]:
    import torch
    import transformers

    common = dict(
        vocab_size=4096,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=512,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    configs = {
        "attention": transformers.LlamaConfig(head_dim=HIDDEN // HEADS, **common),
        "hybrid": transformers.BambaConfig(
            attn_layer_indices=[3, 7],
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
            **common,
        ),
    }
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        paths[name] = f"{root}/{name}"
        model.save_pretrained(paths[name])
    return paths


def bytes_per_request(llm, context: int) -> int:
    """Pool bytes one request of `context` tokens holds: its blocks in every group, each block
    being one page in each of the pool's buffers (a buffer is shared by one layer per group)."""
    config = llm.engine.kv_cache_config
    page = config.kv_cache_tensors[0].size_bytes // config.num_blocks
    blocks = sum(
        -(-g.kv_cache_spec.max_memory_usage_bytes(context) // g.kv_cache_spec.page_size_bytes)
        for g in config.kv_cache_groups
    )
    return blocks * page * len(config.kv_cache_tensors)


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from tokenos import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def measure_context(path: str, context: int, batch: int, new_tokens: int, seed: int) -> dict:
    """Prefill `batch` prompts of `context` tokens, then time decoding alone: the same prompts
    again hit the prefix cache (all but at most one block), so the second run is the decode."""
    from tokenos import LLM

    rng = random.Random(seed)
    llm = LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=context + new_tokens + 8,
        max_num_batched_tokens=2048,
    )
    prompts = [[rng.randrange(3, 4096) for _ in range(context)] for _ in range(batch)]
    prefill = timed_generate(llm, prompts, 1)
    decode = timed_generate(llm, prompts, new_tokens + 1)
    return {
        "context": context,
        "batch": batch,
        "prefill_s": round(prefill, 2),
        "decode_tok_s": round(batch * (new_tokens + 1) / decode, 1),
        "kv_bytes_per_request": bytes_per_request(llm, context),
    }


def measure_prefix_ttft(path: str, prefix_len: int, suffix_len: int, seed: int) -> dict:
    from tokenos import LLM

    rng = random.Random(seed)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=prefix_len + suffix_len + 16)
    prefix = [rng.randrange(3, 4096) for _ in range(prefix_len)]

    def fresh() -> list[int]:
        return prefix + [rng.randrange(3, 4096) for _ in range(suffix_len)]

    cold = timed_generate(llm, [fresh()], 1)
    before = llm.get_metrics()["prefix_cache_hits"]
    warm = timed_generate(llm, [fresh()], 1)
    hit = llm.get_metrics()["prefix_cache_hits"] - before
    return {
        "prefix_len": prefix_len,
        "ttft_cold_s": round(cold, 3),
        "ttft_hit_s": round(warm, 3),
        "hit_tokens": hit,
        "block_size": llm.engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
    }


def measure_fork(path: str, prompt_len: int, n: int, new_tokens: int, seed: int) -> dict:
    """One prompt, n samples: `SamplingParams(n=n)` (samples 1..n-1 fork from sample 0) against n
    separate requests of the same prompt submitted together (no fork: a hybrid copy can only resume
    from another's checkpoint once it is written, so most of the prompt is computed again)."""
    from tokenos import LLM, SamplingParams
    from tokenos.bench.recording import record_schedules

    rng = random.Random(seed)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=prompt_len + new_tokens + 16)
    scheduled = record_schedules(llm)
    row: dict = {"prompt_len": prompt_len, "n": n, "new_tokens": new_tokens}
    for name in ("fork", "copies"):
        prompt = [rng.randrange(3, 4096) for _ in range(prompt_len)]  # fresh: no earlier hits
        samples = n if name == "fork" else 1
        params = SamplingParams(
            n=samples, temperature=1.0, seed=seed, max_tokens=new_tokens, ignore_eos=True, detokenize=False
        )
        requests = [{"prompt_token_ids": prompt}] * (n // samples)
        scheduled.clear()
        t = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        row[f"{name}_s"] = round(time.perf_counter() - t, 3)
        row[f"{name}_tokens_computed"] = sum(out.total_num_scheduled_tokens for out in scheduled)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenos bench hybrid", description=__doc__)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--fork-n", type=int, default=4, help="samples per prompt in the fork measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sections", default="context,prefix,fork", help="comma-separated subset of context,prefix,fork"
    )
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as root:
        paths = write_checkpoints(root, max(contexts) + args.new_tokens + 64)
        for name, path in paths.items():
            rows = []
            if "context" in sections:
                rows += [measure_context(path, c, args.batch, args.new_tokens, args.seed) for c in contexts]
            if "prefix" in sections:
                rows.append(measure_prefix_ttft(path, args.prefix_len, 32, args.seed))
            if "fork" in sections:
                rows.append(measure_fork(path, args.prefix_len, args.fork_n, args.new_tokens, args.seed))
            for row in rows:
                print(json.dumps({"model": name, **row}), flush=True)


if __name__ == "__main__":
    main()
