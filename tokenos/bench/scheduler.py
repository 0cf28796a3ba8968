"""Micro-benchmark of the scheduler's per-step cost: `python -m tokenos.bench.scheduler`.

Runs R decode requests (prefix caching on, one full-attention group of 16-token blocks) and
times schedule() plus update_from_output() with a canned model output, so only the core's
Python is measured. Prints one line per size:
`running=256 step_us=1234.5 per_request_us=4.8`. Target: per_request_us < 10.
"""

from __future__ import annotations

import argparse
import time

from tokenos.config import CacheConfig, SchedulerConfig
from tokenos.core.kv_cache.spec import FullAttentionSpec, get_kv_cache_config
from tokenos.core.request import Request
from tokenos.core.sched.output import ModelRunnerOutput
from tokenos.core.sched.scheduler import Scheduler
from tokenos.sampling_params import SamplingParams


def bench(
    num_running: int, num_steps: int, prompt_len: int = 128, block_size: int = 16
) -> tuple[float, float]:
    max_model_len = prompt_len + num_steps + 64
    cfg = get_kv_cache_config(
        {f"layer{i}": FullAttentionSpec(block_size, 8, 128, "bfloat16") for i in range(4)},
        available_memory_bytes=None,
        num_blocks=num_running * (max_model_len // block_size + 2) + 1,
        max_model_len=max_model_len,
    )
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(8192, num_running * prompt_len), max_num_seqs=num_running),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        cfg,
        max_model_len,
    )
    shared = list(range(1, prompt_len // 2 + 1))  # half of every prompt is a shared system prompt
    for i in range(num_running):
        prompt = shared + [1000 + i * prompt_len + j for j in range(prompt_len - len(shared))]
        params = SamplingParams(max_tokens=num_steps + 8, ignore_eos=True)
        sched.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2, arrival_time=float(i)))

    def model_output(scheduler_output) -> ModelRunnerOutput:
        ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(ids, {r: k for k, r in enumerate(ids)}, [[7] for _ in ids])

    scheduler_output = sched.schedule()  # the prefill step, not timed
    sched.update_from_output(scheduler_output, model_output(scheduler_output))
    scheduler_output = sched.schedule()
    canned = model_output(scheduler_output)  # the same requests decode every step, in the same order
    sched.update_from_output(scheduler_output, canned)

    t0 = time.perf_counter()
    for _ in range(num_steps):
        scheduler_output = sched.schedule()
        sched.update_from_output(scheduler_output, canned)
    elapsed = time.perf_counter() - t0
    assert len(scheduler_output.num_scheduled_tokens) == num_running, "not every request decoded every step"
    step_us = elapsed / num_steps * 1e6
    return step_us, step_us / num_running


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    for n in args.sizes:
        bench(n, num_steps=20)  # warm-up
        step_us, per_req = bench(n, args.steps)
        print(f"running={n} step_us={step_us:.1f} per_request_us={per_req:.2f}", flush=True)


if __name__ == "__main__":
    main()
