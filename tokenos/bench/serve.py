"""`tokenos bench serve`: load-test any OpenAI-compatible server over HTTP, like `vllm bench serve`.

Requests are token-id prompts sent to /v1/completions (no tokenizer needed on this side), greedy,
optionally with ignore_eos so every request produces exactly its max_tokens. Datasets: `random`
(input/output lengths drawn around a mean), `prefix-repetition` (a few shared prefixes + unique
suffixes, for prefix caching) and `workload` (the shared .jsonl format, ../shared/bench/).
Arrivals are a Poisson process at `--request-rate` (inf: all at once), optionally capped by
`--max-concurrency`. With streaming, each request's time to first token (TTFT), the gaps between
chunks (ITL), time per output token after the first (TPOT) and end-to-end latency (E2EL) are
measured; the report is a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

# Token ids valid for SmolLM2's vocabulary (49,152) and any larger one, clear of special tokens.
TOKEN_ID_RANGE = (100, 49052)
PERCENTILES = (50, 90, 99)
DEFAULT_NUM_PROMPTS = 100


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks
    error: str = ""


# ------------------------------------------------------------------ datasets


def _random_ids(rng: random.Random, n: int) -> list[int]:
    lo, hi = TOKEN_ID_RANGE
    return [rng.randrange(lo, hi) for _ in range(n)]


def _around(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(lo, hi))


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            _random_ids(rng, _around(rng, input_len, range_ratio)), _around(rng, output_len, range_ratio)
        )
        for _ in range(num_prompts)
    ]


def prefix_repetition_dataset(
    num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """`num_prompts` requests over `num_prefixes` shared prefixes (round robin), shuffled."""
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len) for _ in range(num_prefixes)]
    requests = [
        BenchRequest(prefixes[i % num_prefixes] + _random_ids(rng, suffix_len), output_len)
        for i in range(num_prompts)
    ]
    rng.shuffle(requests)
    return requests


def load_workload(path: str, num_prompts: int | None = None) -> list[BenchRequest]:
    """The shared workload format: one {"prompt_token_ids": [...], "max_tokens": N} per line."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    requests = [BenchRequest(row["prompt_token_ids"], row["max_tokens"]) for row in rows]
    return requests[:num_prompts] if num_prompts else requests


def make_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "workload" or args.workload:
        if not args.workload:
            raise SystemExit("--dataset workload needs --workload FILE.jsonl")
        return load_workload(args.workload, args.num_prompts)
    num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS
    if args.dataset == "prefix-repetition":
        return prefix_repetition_dataset(
            num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len, args.seed
        )
    return random_dataset(num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)


# ------------------------------------------------------------------ sending


async def arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> AsyncIterator[BenchRequest]:
    """Yield requests as a Poisson process of `rate` per second (inf: no waiting)."""
    rng = random.Random(seed)
    for i, request in enumerate(requests):
        yield request
        if math.isfinite(rate) and i < len(requests) - 1:
            await asyncio.sleep(rng.expovariate(rate))


def completion_body(request: BenchRequest, model: str, ignore_eos: bool, stream: bool) -> dict:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]
) -> RequestResult:
    result = RequestResult(success=False, prompt_tokens=len(body["prompt"]))
    start = time.perf_counter()
    try:
        if body["stream"]:
            await _read_stream(client, url, body, headers, start, result)
        else:
            r = await client.post(url, json=body, headers=headers)
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return result
            result.output_tokens = r.json()["usage"]["completion_tokens"]
            result.ttft_s = time.perf_counter() - start
        result.latency_s = time.perf_counter() - start
        result.success = not result.error
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _read_stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict[str, str],
    start: float,
    result: RequestResult,
) -> None:
    last = start
    chunks = 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                result.error = event["error"].get("message", "error event")
                return
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
            if not event.get("choices"):
                continue
            now = time.perf_counter()
            if chunks == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            chunks += 1
    if not result.output_tokens:
        result.output_tokens = chunks  # a server that sends no usage: one token per chunk


async def run_requests(
    requests: list[BenchRequest],
    url: str,
    model: str,
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    stream: bool = True,
    api_key: str | None = None,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send every request; returns the results (in request order) and the wall time in seconds."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or len(requests)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=connections)) as client:

        async def one(request: BenchRequest) -> RequestResult:
            body = completion_body(request, model, ignore_eos, stream)
            if limit is None:
                return await send_request(client, url, body, headers)
            async with limit:
                return await send_request(client, url, body, headers)

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(r)) async for r in arrivals(requests, request_rate, seed)]
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ------------------------------------------------------------------ statistics


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _describe(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    stats = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = percentile(ms, p)
    return stats


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
    }
    summary |= _describe("ttft", [r.ttft_s for r in ok])
    summary |= _describe("tpot", tpots)
    summary |= _describe("itl", [gap for r in ok for gap in r.itl_s])
    summary |= _describe("e2el", [r.latency_s for r in ok])
    errors = [r.error for r in results if not r.success]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def format_table(summary: dict) -> str:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total generated tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append((f"-- {title} --", ""))
        rows.append((f"Mean {name.upper()} (ms)", f"{summary[f'mean_{name}_ms']:.2f}"))
        rows += [(f"P{p} {name.upper()} (ms)", f"{summary[f'p{p}_{name}_ms']:.2f}") for p in PERCENTILES]
    width = max(len(label) for label, _ in rows) + 2
    lines = ["=" * (width + 12), " Serving Benchmark Result ".center(width + 12, "=")]
    lines += [
        f"{label:<{width}}{value:>12}" if value else label.center(width + 12, " ") for label, value in rows
    ]
    lines.append("=" * (width + 12))
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset", choices=("random", "prefix-repetition", "workload"), default="random")
    parser.add_argument("--workload", default=None, help="shared-format .jsonl (implies --dataset workload)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 100 (workload: all lines)")
    parser.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens")
    parser.add_argument(
        "--output-len", type=int, default=64, help="random / prefix-repetition: output tokens"
    )
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: lengths vary by +-this fraction"
    )
    parser.add_argument("--prefix-len", type=int, default=512, help="prefix-repetition: shared prefix tokens")
    parser.add_argument("--suffix-len", type=int, default=64, help="prefix-repetition: unique suffix tokens")
    parser.add_argument("--num-prefixes", type=int, default=8, help="prefix-repetition: distinct prefixes")
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s, Poisson (inf: all at once)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many in flight")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)


async def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(f"{base_url}/v1/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    requests = make_dataset(args)
    model = args.model or await _first_model(args.base_url, args.api_key)
    results, duration = await run_requests(
        requests,
        args.base_url.rstrip("/") + args.endpoint,
        model,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        stream=args.stream,
        api_key=args.api_key,
        seed=args.seed,
    )
    dataset = os.path.basename(args.workload) if args.workload else args.dataset
    config = {
        "model": model,
        "dataset": dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
    }
    return config | summarize(results, duration)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenos bench serve", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the report
    summary = asyncio.run(run_benchmark(args))
    print(format_table(summary))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}), flush=True)
    return 1 if summary["completed"] == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
