"""`tokenos bench structured`: what grammar masks cost a decode step.

The same batch of requests (random token-id prompts, greedy, exactly ``--output-len`` tokens) runs
unconstrained and then under a grammar that never completes early (``--regex``, with EOS held back by
min_tokens), so both do identical model work. Each is timed at 1 output token and at ``--output-len``;
the difference over the extra tokens is the decode step time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tokenos.engine.flags import add_engine_args, engine_kwargs, parse_args


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--regex", default="[a-z ]+", help="the grammar of the constrained run")
    add_engine_args(parser)
    parser.set_defaults(dtype="bfloat16")  # benchmarks run what the peers run


def _wall(llm, prompts: list[dict], params) -> float:
    llm.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> dict:
    from tokenos import LLM, SamplingParams
    from tokenos.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, **engine_kwargs(args))
    rng = random.Random(args.seed)
    hi = min(llm.model_config.vocab_size, 49052)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, hi) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]

    def params(n: int, grammar: bool) -> SamplingParams:
        so = StructuredOutputsParams(regex=args.regex) if grammar else None
        return SamplingParams(
            temperature=0.0,
            max_tokens=n,
            min_tokens=n,
            ignore_eos=True,
            structured_outputs=so,
            detokenize=False,
        )

    _wall(llm, prompts[:4], params(4, True))  # warm-up: kernels, the grammar's compile cache
    result = {"engine": "tokenos", "requests": args.num_prompts, "output_len": args.output_len}
    for name, grammar in (("unconstrained", False), ("constrained", True)):
        first = _wall(llm, prompts, params(1, grammar))
        full = _wall(llm, prompts, params(args.output_len, grammar))
        result[f"{name}_wall_s"] = round(full, 2)
        result[f"{name}_decode_step_ms"] = round(1e3 * (full - first) / max(args.output_len - 1, 1), 2)
    base = result["unconstrained_decode_step_ms"]
    # NaN where noise left no measurable unconstrained step (a difference of two walls).
    result["mask_cost_pct"] = (
        round(100 * (result["constrained_decode_step_ms"] / base - 1), 1) if base > 0 else float("nan")
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenos bench structured", description=__doc__)
    add_args(parser)
    print(json.dumps(run(parse_args(parser, argv))), flush=True)


if __name__ == "__main__":
    main()
