"""`tokenos bench throughput`: offline throughput on a workload file or a synthetic one.

Workload files are the shared format (one `{"prompt_token_ids", "max_tokens"}` per line,
run greedy with ignore_eos so every request produces exactly max_tokens). Prints one JSON
line: requests/s, input/output/total tokens/s, wall time and start-up time.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from tokenos.engine.flags import add_engine_args, engine_kwargs, parse_args


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", help="shared-format .jsonl workload file")
    parser.add_argument("--num-prompts", type=int, default=64, help="synthetic: number of requests")
    parser.add_argument("--input-len", type=int, default=256, help="synthetic: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="synthetic: output tokens")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument(
        "--keep-warmup-cache",
        action="store_true",
        help="keep the warm-up's blocks in the prefix cache for the timed run, as the vLLM peer harness "
        "does with prefix caching on (by default the cache is emptied after the warm-up)",
    )
    parser.add_argument(
        "--num-loras",
        type=int,
        default=0,
        help="LoRA: random adapters (on every attention and MLP projection), request i under adapter "
        "i mod N; turns --enable-lora on and --max-loras up to N",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA: the random adapters' rank (16)")
    add_engine_args(parser)
    parser.set_defaults(dtype="bfloat16")  # benchmarks run what the peers run


def load_workload(args: argparse.Namespace, vocab_size: int) -> list[dict]:
    if args.workload:
        with open(args.workload) as f:
            return [json.loads(line) for line in f if line.strip()]
    rng = random.Random(args.seed)
    hi = min(vocab_size, 49052)
    return [
        {
            "prompt_token_ids": [rng.randrange(100, hi) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
        }
        for _ in range(args.num_prompts)
    ]


def run(args: argparse.Namespace) -> dict:
    from tokenos import LLM

    kwargs = engine_kwargs(args)
    if args.num_loras:
        kwargs["enable_lora"] = True
        kwargs["max_loras"] = max(kwargs.get("max_loras") or 1, args.num_loras)
        kwargs["max_lora_rank"] = max(kwargs.get("max_lora_rank") or 16, args.lora_rank)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    startup = time.perf_counter() - t0
    rows = load_workload(args, llm.model_config.vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        loras = random_loras(llm, folder, args.num_loras, args.lora_rank, len(rows))
        return _timed(args, llm, rows, loras, startup)


def random_loras(llm, folder: str, count: int, rank: int, num_requests: int) -> list | None:
    """`count` random adapters loaded into `llm`; the adapter of each request (None: no LoRA)."""
    if not count:
        return None
    from tokenos.bench.lora import write_random_adapter
    from tokenos.lora import LoRARequest

    adapters = [
        LoRARequest(
            f"bench-lora-{i}", i + 1, write_random_adapter(llm.model_config, f"{folder}/{i}", rank, i)
        )
        for i in range(count)
    ]
    for adapter in adapters:
        llm.add_lora(adapter)
    return [adapters[i % count] for i in range(num_requests)]


def _timed(args: argparse.Namespace, llm, rows: list[dict], loras: list | None, startup: float) -> dict:
    from tokenos import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
        for r in rows
    ]
    if not args.no_warmup:
        llm.generate(prompts[:4], params[:4], use_tqdm=False, lora_request=loras[:4] if loras else None)
        if not args.keep_warmup_cache:
            llm.reset_prefix_cache()
    before = llm.get_metrics()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(r["prompt_token_ids"]) for r in rows)
    after = llm.get_metrics()
    metrics = {
        k: after[k] - before[k] for k in ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")
    }
    return {
        "engine": "tokenos",
        "workload": args.workload.split("/")[-1]
        if args.workload
        else f"random-{args.input_len}-{args.output_len}",
        "requests": len(rows),
        "dtype": llm.engine_args.dtype,
        "prefix_caching": llm.engine_args.enable_prefix_caching,  # as resolved (the flag may be unset)
        "wall_s": round(wall, 2),
        "requests_s": round(len(rows) / wall, 2),
        "input_tok_s": round(n_in / wall, 1),
        "output_tok_s": round(n_out / wall, 1),
        "total_tok_s": round((n_in + n_out) / wall, 1),
        "startup_s": round(startup, 1),
        "prefix_cache_hit_rate": round(
            metrics["prefix_cache_hits"] / max(metrics["prefix_cache_queries"], 1), 3
        ),
        "num_preemptions": metrics["num_preemptions"],
        **({"num_loras": args.num_loras, "lora_rank": args.lora_rank} if loras else {}),
        **spec_figures(before, after),
    }


def spec_figures(before: dict, after: dict) -> dict:
    """Speculative decoding in the timed run: acceptance rate and mean acceptance length."""
    if "spec_decoding" not in after:
        return {}
    from tokenos.entrypoints.llm import spec_summary

    was, now = before["spec_decoding"], after["spec_decoding"]
    timed = {key: now[key] - was[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pairs = zip(now["accepted_per_pos"], was["accepted_per_pos"], strict=True)
    timed["accepted_per_pos"] = [a - b for a, b in pairs]
    summary = spec_summary(timed)
    return {
        "spec_draft_tokens": summary["num_draft_tokens"],
        "spec_acceptance_rate": round(summary["acceptance_rate"], 3),
        "spec_mean_acceptance_length": round(summary["mean_acceptance_length"], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenos bench throughput", description=__doc__)
    add_args(parser)
    print(json.dumps(run(parse_args(parser, argv))), flush=True)


if __name__ == "__main__":
    main()
