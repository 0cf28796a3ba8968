"""Peer figures for `tokenos bench hybrid`: the same checkpoints through vLLM or transformers.

Write the checkpoints once with tokenos (`python -c "from tokenos.bench.hybrid import write_checkpoints;
write_checkpoints('/tmp/hyb', 16640)"`), then run this file with the peer's interpreter, e.g.
`VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 ~/.cache/tokenos-peers/vllm/bin/python
tools/hybrid_peers.py vllm /tmp/hyb/attention --context 4096` or `python tools/hybrid_peers.py hf
/tmp/hyb/hybrid --fork`. It imports nothing from tokenos (peer environments do not have it) and
measures what the bench measures: decode tokens/s for 2 prompts of `--context` tokens (128 new tokens,
after a 1-token run), or one 2048-token prompt with 4 samples against 4 copies of it (`--fork`).
"""

from __future__ import annotations

import argparse
import json
import random
import time


def vllm_run(path: str, prompts: list[list[int]], n: int, max_tokens: int, max_len: int, llm=None):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if llm is None:
        llm = LLM(
            path, dtype="float32", skip_tokenizer_init=True, max_model_len=max_len, enable_prefix_caching=True
        )
    params = SamplingParams(
        n=n, temperature=1.0 if n > 1 else 0, seed=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t, llm


def hf_run(path: str, prompts: list[list[int]], n: int, max_tokens: int, max_len: int, llm=None):
    import torch
    from transformers import AutoModelForCausalLM

    if llm is None:
        torch.set_num_threads(2)
        llm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t = time.perf_counter()
    with torch.no_grad():
        llm.generate(
            torch.tensor(prompts),
            do_sample=n > 1,
            num_return_sequences=n,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
        )
    return time.perf_counter() - t, llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("engine", choices=("vllm", "hf"))
    parser.add_argument("path")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--fork", action="store_true")
    args = parser.parse_args()
    run = vllm_run if args.engine == "vllm" else hf_run
    rng = random.Random(0)
    if args.fork:
        prompt = [rng.randrange(3, 4096) for _ in range(2048)]
        fork_s, llm = run(args.path, [prompt], 4, 32, 2048 + 64)
        row = {"n4_s": round(fork_s, 3)}
        if args.engine == "vllm":  # transformers has no cross-request sharing: copies == n=4
            prompt = [rng.randrange(3, 4096) for _ in range(2048)]
            row["copies_s"] = round(run(args.path, [prompt] * 4, 1, 32, 2048 + 64, llm)[0], 3)
    else:
        prompts = [[rng.randrange(3, 4096) for _ in range(args.context)] for _ in range(2)]
        prefill, llm = run(args.path, prompts, 1, 1, args.context + 160)
        full = run(args.path, prompts, 1, 129, args.context + 160, llm)[0]
        decode = full if args.engine == "vllm" else full - prefill  # vLLM reruns from its prefix cache
        row = {
            "context": args.context,
            "prefill_s": round(prefill, 2),
            "decode_tok_s": round(2 * 128 / decode, 1),
        }
    print(json.dumps({"engine": args.engine, "model": args.path, **row}), flush=True)


if __name__ == "__main__":
    main()
