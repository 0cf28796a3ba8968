"""Beam search: the search on hand-made distributions (where greedy and the best beam differ, EOS, length
penalty), then through `LLM.beam_search` on a tiny model against transformers' scores of the sequences it
returns. Also the offline conveniences around it: `LLM.chat(continue_final_message=True)` and the
progress and start-up lines an offline script prints when stderr is not a terminal."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.fixtures.checkpoints import save_served
from tokenos.entrypoints.beam_search import BeamSearchParams, beam_search

EOS = 0
LN = math.log
# next-token distributions by the tokens so far (after the prompt [9])
TREE = {
    (9,): {1: LN(0.6), 2: LN(0.4)},
    (9, 1): {3: LN(0.3), 4: LN(0.3), EOS: LN(0.4)},
    (9, 2): {5: LN(0.9), 6: LN(0.1)},
    (9, 1, EOS): {7: LN(1.0)},  # reached only with ignore_eos
    (9, 1, 3): {7: LN(1.0)},
    (9, 1, 4): {7: LN(1.0)},
    (9, 2, 5): {7: LN(1.0)},
    (9, 2, 6): {7: LN(1.0)},
}


def step(beams: list[list[int]], k: int) -> list[dict[int, float]]:
    return [dict(sorted(TREE[tuple(b)].items(), key=lambda kv: -kv[1])[:k]) for b in beams]


def test_beams_find_what_greedy_misses():
    (greedy,) = beam_search([[9]], BeamSearchParams(beam_width=1, max_tokens=3, ignore_eos=True), step, EOS)
    assert greedy[0].output_tokens == [1, EOS, 7]  # 0.6 * 0.4 = 0.24 (EOS goes on: ignore_eos)
    (beams,) = beam_search([[9]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True), step, EOS)
    assert beams[0].output_tokens == [2, 5, 7]  # 0.4 * 0.9 = 0.36
    assert beams[0].cum_logprob == pytest.approx(LN(0.36)) and beams[0].logprobs == pytest.approx(
        [LN(0.4), LN(0.9), 0]
    )


def test_eos_finishes_a_beam_and_length_penalty_ranks():
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)  # raw cumulative logprob
    (beams,) = beam_search([[9]], params, step, EOS)
    # [1, EOS] = 0.24 finished at step 2 is worse than [2, 5, 7] = 0.36, better than [1, 3, 7] = 0.18
    assert [b.output_tokens for b in beams] == [[2, 5, 7], [1]]
    assert [b.finish_reason for b in beams] == ["length", "stop"]
    kept = beam_search(
        [[9]], BeamSearchParams(2, 3, length_penalty=0.0, include_stop_str_in_output=True), step, EOS
    )
    assert kept[0][1].output_tokens == [1, EOS]
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=0, max_tokens=1)


@pytest.mark.slow
def test_llm_beam_search_scores_match_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tokenos import LLM, SamplingParams

    folder = save_served("llama", str(tmp_path / "tiny"))
    llm = LLM(folder, dtype="float32", max_model_len=256)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, 400, 2000, 31, 7]
    (one,) = llm.beam_search(
        [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    )
    (greedy,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert one.sequences[0].output_tokens == greedy.outputs[0].token_ids
    (out,) = llm.beam_search(
        [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    )
    assert len(out.sequences) == 3 and all(s.tokens[: len(prompt)] == prompt for s in out.sequences)
    cums = [s.cum_logprob for s in out.sequences]
    assert cums == sorted(cums, reverse=True)
    with torch.no_grad():
        for seq in out.sequences:
            logprobs = torch.log_softmax(ref(torch.tensor([seq.tokens])).logits[0].float(), -1)
            want = sum(logprobs[p - 1, seq.tokens[p]].item() for p in range(len(prompt), len(seq.tokens)))
            assert seq.cum_logprob == pytest.approx(want, abs=2e-3)
            assert seq.text == llm.tokenizer.decode(seq.tokens)
    # continue_final_message: the last assistant message is continued, not closed
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    text = llm.input_processor.render_chat(
        messages, add_generation_prompt=False, continue_final_message=True
    ).text
    assert text.endswith("one, two,")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(messages, continue_final_message=True)
    assert llm.chat(
        messages, SamplingParams(max_tokens=2), add_generation_prompt=False, continue_final_message=True
    )


@pytest.mark.slow
def test_offline_script_logs_start_up_and_progress(tmp_path):
    folder = save_served("llama", str(tmp_path / "tiny"))
    script = (
        "from tokenos import LLM, SamplingParams\n"
        f"llm = LLM({folder!r}, dtype='float32', max_model_len=128)\n"
        "llm.generate(['a', 'b', 'c'], SamplingParams(max_tokens=2))\n"
    )
    env = dict(os.environ, TOKENOS_CONFIGURE_LOGGING="1", TOKENOS_PROGRESS_INTERVAL_S="0")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "engine core ready" in done.stderr
    assert "Processed prompts: 3/3 (100%)" in done.stderr
