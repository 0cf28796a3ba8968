"""Multi-LoRA through the offline `LLM`: each adapter's greedy tokens and logprobs equal transformers +
PEFT's, in batches that mix adapters with base-model requests, under chunked prefill, preemption and
n > 1, for families whose q/k/v and gate/up we fuse (Llama, Qwen2 with biases) or whose checkpoint
already fuses them (Phi-3); and every other dense family in one mixed batch."""

from __future__ import annotations

import pytest

import tokenos.lora.manager as manager_module
from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import DENSE, hf_generate_greedy, make_llm
from tests.fixtures.lora import ATTENTION, MLP, save_adapter
from tokenos import SamplingParams
from tokenos.bench.recording import record_schedules
from tokenos.lora import LoRARequest

pytest.importorskip("peft")

MAX_TOKENS = DENSE.max_tokens


def _family_targets(family: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(a small adapter's targets, a full one's): Phi-3's checkpoint names its fused projections."""
    if family == "phi3":
        return ("qkv_proj",), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return ("q_proj", "v_proj"), ATTENTION + MLP


@pytest.fixture(scope="module", params=["llama", "qwen2", "phi3"])
def setup(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base_folder = str(root / "base")
    base = save_tiny(family, base_folder, **LLM_SHAPE)
    small, full = _family_targets(family)
    refs = {
        "small": save_adapter(base_folder, str(root / "small"), r=8, alpha=16, targets=small, seed=1),
        "full": save_adapter(
            base_folder, str(root / "full"), r=16, alpha=8, targets=full, seed=2, use_rslora=True
        ),
    }
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(refs)}
    return base_folder, base, refs, loras


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, n=n)


def _generate(llm, prompts, choice, loras, n: int = 1):
    """Greedy completions, prompt i under adapter ``choice[i]`` (None: the base model)."""
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _greedy(n),
        use_tqdm=False,
        lora_request=[loras[c] if c else None for c in choice],
    )


def _check(outputs, prompts, choice, base, refs) -> None:
    for out, prompt, name in zip(outputs, prompts, choice, strict=True):
        ref_tokens, ref_logprobs = hf_generate_greedy(
            base if name is None else refs[name], prompt, MAX_TOKENS
        )
        for completion in out.outputs:
            assert completion.token_ids == ref_tokens, f"adapter {name}: prompt of {len(prompt)} diverged"
            ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
            for a, b in zip(ours, ref_logprobs, strict=True):
                assert abs(a - b) < 1e-3, (name, a, b)


SCHEDULES = {
    "mixed": dict(),
    "chunked": dict(max_num_batched_tokens=24),
    "preemption": dict(num_kv_blocks=17, max_model_len=128, enable_prefix_caching=False),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_adapters_match_peft_in_mixed_batches(setup, schedule):
    base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=2, max_lora_rank=16, **SCHEDULES[schedule])
    prompts = DENSE.prompts(9, 5, 30, seed=3)
    choice = [[None, "small", "full"][i % 3] for i in range(len(prompts))]
    recorded = record_schedules(llm)
    outputs = _generate(llm, prompts, choice, loras)
    _check(outputs, prompts, choice, base, refs)
    if schedule == "preemption":
        assert llm.get_metrics()["num_preemptions"] > 0
    if schedule == "chunked":
        assert any(out.total_num_scheduled_tokens == 24 for out in recorded)


def test_adapters_change_the_output(setup):
    """The adapters are not no-ops (else parity would prove nothing)."""
    base_folder, base, refs, _ = setup
    prompt = DENSE.prompts(1, 12, 12, seed=5)[0]
    plain = hf_generate_greedy(base, prompt, MAX_TOKENS)[1]
    for ref in refs.values():
        adapted = hf_generate_greedy(ref, prompt, MAX_TOKENS)[1]
        assert max(abs(a - b) for a, b in zip(plain, adapted, strict=True)) > 1e-2


def test_n_greater_than_one_under_an_adapter(setup):
    base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=2, max_lora_rank=16)
    prompts = DENSE.prompts(2, 8, 20, seed=7)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(n=3), use_tqdm=False, lora_request=loras["full"]
    )
    _check(outputs, prompts, ["full", "full"], base, refs)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "olmo2", "granite", "gemma2", "gemma3_text"])
def test_every_dense_family_takes_adapters(family, tmp_path):
    """The other dense families' attention and MLP projections, in one mixed batch."""
    base_folder = str(tmp_path / "base")
    base = save_tiny(family, base_folder, **LLM_SHAPE)
    refs = {"full": save_adapter(base_folder, str(tmp_path / "full"), r=8, targets=ATTENTION + MLP, seed=4)}
    lora = LoRARequest("full", 1, str(tmp_path / "full"))
    llm = make_llm(base_folder, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = DENSE.prompts(4, 5, 30, seed=6)
    choice = [None, "full", None, "full"]
    outputs = _generate(llm, prompts, choice, {"full": lora})
    _check(outputs, prompts, choice, base, refs)


def test_one_adapter_alone_runs_merged(setup, monkeypatch):
    """Batches that one adapter has to itself run it merged into the dense weights after a run of such
    steps: the same tokens and logprobs, again after switching to the other adapter and back, and a
    mixed batch afterwards takes the segment path with the last adapter's copies still held."""
    base_folder, base, refs, loras = setup
    monkeypatch.setattr(manager_module, "MERGE_AFTER_STEPS", 3)
    llm = make_llm(base_folder, enable_lora=True, max_loras=2, max_lora_rank=16)
    manager = llm.engine.model_runner.lora
    merged: list[str | None] = []
    set_step = manager.set_step
    manager.set_step = lambda *a: set_step(*a) or merged.append(manager.step.merged)
    prompts = DENSE.prompts(3, 5, 30, seed=11)
    for choice in (["small"] * 3, ["full"] * 3, ["small"] * 3, [None, "small", "full"]):
        merged.clear()
        _check(_generate(llm, prompts, choice, loras), prompts, choice, base, refs)
        keys = {manager.registered[c].key if c else None for c in choice}
        if len(keys) == 1:
            assert merged.count(keys.pop()) == len(merged) - 2  # all but the run's first 2 steps
        else:
            assert set(merged) == {None}
    assert any(layer.merged is not None for layer in manager.layers.values())


def test_speculative_decoding_under_adapters(setup):
    """n-gram drafts verified in the adapters' own forward pass: greedy output unchanged, drafts accepted."""
    base_folder, base, refs, loras = setup
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_llm(base_folder, enable_lora=True, max_loras=2, max_lora_rank=16, speculative_config=spec)
    motifs = DENSE.prompts(3, 4, 6, seed=9)
    prompts = [(m * 6)[:30] for m in motifs]  # repeats for prompt lookup to find
    choice = ["small", "full", None]
    outputs = _generate(llm, prompts, choice, loras)
    _check(outputs, prompts, choice, base, refs)
    assert llm.get_metrics()["spec_decoding"]["num_draft_tokens"] > 0
