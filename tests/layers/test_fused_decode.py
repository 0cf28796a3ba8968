"""The fused decode layer (`tokenos.layers.fused_decode`, csrc/decode_layer.c) against the module path.

It runs the module path's kernels in the module path's order, so decode steps must give the same
tokens and the same logprobs bit for bit: over Llama (GQA), Qwen2 (q/k/v bias) and Mistral (sliding
window) with int4 and int8 weights, in float32 and (where native) bf16, with batches that grow and
shrink, a prefix-cache hit and preemption, on pages of the model's dtype and on fp8 / int8 pages. Steps it
must not take (prefill rows, 8-bit pages before their scales are fixed, layers it does not fuse) fall back
to the module path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.kernels import batch_invariant
from tests.fixtures.llm import generate_greedy, make_llm, random_prompts
from tokenos.layers import attention, cpu_kernels
from tokenos.layers.fused_decode import FusedDecodePlan
from tokenos.models.llama import DecoderModel

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the C kernels")

# bf16 where the library has the bf16 weight-only kernel (not in an AVX2 build on an AVX-512 CPU).
DTYPES = ["float32"] + (["bfloat16"] if cpu_kernels.qgemm_kernel(torch.bfloat16) is not None else [])
FAMILIES = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 12}}


def _stack(llm) -> DecoderModel:
    return llm.engine.model_runner.model.stack


def _outputs(llm, prompts, n=1):
    """(tokens, logprob of each) of every sample of every prompt."""
    out = generate_greedy(llm, prompts, max_tokens=24, n=n)
    return [[(c.token_ids, _logprobs(c)) for c in o.outputs] for o in out]


def _logprobs(sample) -> list[float]:
    return [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]


def _run(folder, monkeypatch, fused: bool, prompts, n=1, passes=1, max_query=1, **kwargs):
    """(outputs of each pass over ``prompts``, the model's plan, steps it ran, the LLM's metrics) of one
    fresh `LLM`; a second pass hits the prefix cache. ``max_query`` 1: decode-only steps alone are fused
    (those equal the module path bit for bit)."""
    monkeypatch.setenv("TOKENOS_DISABLE_FUSED_DECODE", "0" if fused else "1")
    if max_query is not None:  # None: the plan's own limits
        monkeypatch.setattr(FusedDecodePlan, "max_query", max_query)
    taken = []
    original = FusedDecodePlan.run
    monkeypatch.setattr(FusedDecodePlan, "run", lambda self, *a: taken.append(1) or original(self, *a))
    llm = make_llm(folder, **kwargs)
    outputs = [_outputs(llm, prompts, n) for _ in range(passes)]
    monkeypatch.setattr(FusedDecodePlan, "run", original)
    return outputs, _stack(llm)._fused, len(taken), llm.get_metrics()


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fused") / request.param)
    save_tiny(request.param, folder, **LLM_SHAPE, **FAMILIES[request.param])
    return folder


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8-calibrated", "int8"])
def test_fused_decode_equals_the_module_path(tiny, method, dtype, kv, monkeypatch):
    # 5 requests of different lengths, at most 3 at a time, 16-token blocks: decode batches of 1 to 3
    # rows beside prefills (those steps take the module path), requests joining and leaving. 8-bit pages:
    # the module path calibrates (int8 always, fp8 with calculate_kv_scales) in the first step, a prefill.
    if kv != "auto" and method == "int8":
        pytest.skip("8-bit pages: one weight format is enough")
    prompts = random_prompts(5, 3, 40, seed=11, vocab=LLM_SHAPE["vocab_size"])
    kwargs = dict(quantization=method, dtype=dtype, max_num_seqs=3, block_size=16, max_num_batched_tokens=32)
    kwargs.update(kv_cache_dtype=kv.split("-")[0], calculate_kv_scales=kv.endswith("calibrated"))
    fused, plan, taken, _ = _run(tiny, monkeypatch, True, prompts, **kwargs)
    reference, *_ = _run(tiny, monkeypatch, False, prompts, **kwargs)
    assert isinstance(plan, FusedDecodePlan) and taken > 10
    assert fused == reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fused_decode_equals_the_module_path_under_batch_invariance(tiny, dtype, kv, monkeypatch):
    """Batch invariance sends every bf16 query to the prefill kernel: the fused layer as a chunk of one
    query per token, the module path as a chunk per request; float32 keeps the decode kernel with splits
    from each request's length. Still the module path bit for bit."""
    prompts = random_prompts(5, 3, 40, seed=12, vocab=LLM_SHAPE["vocab_size"])
    kwargs = dict(quantization="int4", dtype=dtype, max_num_seqs=3, block_size=16, max_num_batched_tokens=32)
    with batch_invariant():
        fused, plan, taken, _ = _run(tiny, monkeypatch, True, prompts, kv_cache_dtype=kv, **kwargs)
        reference, *_ = _run(tiny, monkeypatch, False, prompts, kv_cache_dtype=kv, **kwargs)
    assert plan is not None and taken > 10
    assert fused == reference


def test_prefix_hit_preemption_and_n_samples(tiny, monkeypatch):
    shared = random_prompts(1, 40, 40, seed=3, vocab=LLM_SHAPE["vocab_size"])[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 9, seed=4, vocab=LLM_SHAPE["vocab_size"])]
    # Pages for one 256-token request (and the null block), for four of up to 73 tokens with two samples
    # each: preemption; the second pass starts from cached prefixes.
    kwargs = dict(quantization="int4", block_size=16, num_kv_blocks=18, max_num_seqs=8)
    fused, plan, taken, metrics = _run(tiny, monkeypatch, True, prompts, n=2, passes=2, **kwargs)
    reference, *_ = _run(tiny, monkeypatch, False, prompts, n=2, passes=2, **kwargs)
    assert plan is not None and taken > 10
    windowed = "sliding_window" in FAMILIES[Path(tiny).name]  # its pages free as the window moves
    assert (metrics["num_preemptions"] > 0 or windowed) and metrics["prefix_cache_hits"] > 0
    assert fused == reference


def test_steps_and_models_it_does_not_take(tmp_path, monkeypatch):
    folder = str(tmp_path / "llama")
    save_tiny("llama", folder, **LLM_SHAPE)
    prompts = random_prompts(3, 5, 20, seed=1, vocab=LLM_SHAPE["vocab_size"])
    # 8-bit pages whose scales are still open (int8 before its first real K and V): the module path,
    # which calibrates them.
    monkeypatch.setattr(attention.Attention, "kv_scales_settled", lambda self, dtype: False)
    fused, plan, taken, _ = _run(
        folder, monkeypatch, True, prompts, quantization="int4", kv_cache_dtype="int8"
    )
    reference, *_ = _run(folder, monkeypatch, False, prompts, quantization="int4", kv_cache_dtype="int8")
    assert plan is not None and taken == 0 and fused == reference
    monkeypatch.undo()
    # Dense weights (oneDNN's GEMM, not ours): no plan.
    assert _run(folder, monkeypatch, True, prompts[:1])[1] is None
    qwen3 = str(tmp_path / "qwen3")  # per-head q/k norms: not fused
    save_tiny("qwen3", qwen3, **LLM_SHAPE)
    assert _run(qwen3, monkeypatch, True, prompts[:1], quantization="int4")[1] is None


def test_disabled_by_environment(tmp_path, monkeypatch):
    folder = str(tmp_path / "llama")
    save_tiny("llama", folder, **LLM_SHAPE)
    monkeypatch.setenv("TOKENOS_DISABLE_FUSED_DECODE", "1")
    llm = make_llm(folder, quantization="int4")
    generate_greedy(llm, [[5, 6, 7]], max_tokens=2)
    assert _stack(llm)._fused is None


def _check_verify_steps(folder, monkeypatch, prompts, spec, max_query, tolerance, **kwargs):
    """Runs ``prompts`` fused with speculation, fused without, and through the module path with it:
    greedy tokens equal in all three, logprobs within ``tolerance`` of the module path's. Returns the
    query lengths of each fused step and the speculating run's metrics."""
    steps = []
    original = FusedDecodePlan._step
    monkeypatch.setattr(
        FusedDecodePlan,
        "_step",
        lambda self, meta, batch, *a: (
            steps.append((meta.num_reqs, meta.query_lens_list)) or original(self, meta, batch, *a)
        ),
    )
    fused, _, taken, metrics = _run(
        folder, monkeypatch, True, prompts, max_query=max_query, speculative_config=spec, **kwargs
    )
    assert taken and metrics["spec_decoding"]["num_accepted_tokens"] > 0
    plain, *_ = _run(folder, monkeypatch, True, prompts, max_query=max_query, **kwargs)
    module, *_ = _run(folder, monkeypatch, False, prompts, speculative_config=spec, **kwargs)
    tokens = [[sample[0] for sample in out] for out in fused[0]]
    assert tokens == [[sample[0] for sample in out] for out in plain[0]]
    assert tokens == [[sample[0] for sample in out] for out in module[0]]
    ours = [lp for out in fused[0] for sample in out for lp in sample[1]]
    theirs = [lp for out in module[0] for sample in out for lp in sample[1]]
    assert ours == pytest.approx(theirs, abs=tolerance)
    return steps


def test_verify_steps_attend_as_decodes_of_their_own_length(tmp_path, monkeypatch):
    """Speculation's verify steps (a decode and its drafts per request) are fused too: each token attends
    through the decode kernel up to its own position. Greedy output equals no speculation, and
    logprobs equal the module path's (which takes the prefill kernel for those rows) within float32
    rounding."""
    folder = str(tmp_path / "llama")
    save_tiny("llama", folder, **LLM_SHAPE)
    base = random_prompts(4, 4, 8, seed=9, vocab=LLM_SHAPE["vocab_size"])
    prompts = [p * 4 for p in base]  # repeats: n-gram drafts get accepted
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kwargs = dict(quantization="int4", max_num_seqs=3, block_size=16)
    steps = _check_verify_steps(folder, monkeypatch, prompts, spec, 8, 1e-4, **kwargs)
    assert any(reqs < sum(lens) for reqs, lens in steps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_verify_steps_are_fused_where_cascade_groups_a_request(tmp_path, monkeypatch, dtype):
    """Where cascade attention groups a request's tokens over their common pages (AVX2: every page
    dtype; AVX512-BF16: bf16 pages), verify steps of up to 16 tokens a request (a decode and 15 drafts)
    take the fused path; greedy output equals decoding without speculation and the module path's, and
    logprobs stay close to the module path's. Where it does not, each token would read its whole
    context: 8 tokens a request at most."""
    torch_dtype = getattr(torch, dtype)
    if not cpu_kernels.uses_cascade(torch_dtype):
        pytest.skip(f"no cascade attention over {dtype} pages on this CPU")
    folder = str(tmp_path / "llama")
    save_tiny("llama", folder, **LLM_SHAPE)
    # bf16: kernels that sum in another order may flip a near-tie (seeds 3 and 11 have one); seed 1 none.
    base = random_prompts(3, 16, 20, seed=1, vocab=LLM_SHAPE["vocab_size"])
    prompts = [p * 4 for p in base]  # periods past 12 tokens: whole 12-token drafts to follow
    spec = {"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    kwargs = dict(quantization="int4", max_num_seqs=1, block_size=16, dtype=dtype)
    tolerance = 0.05 if dtype == "bfloat16" else 1e-4
    steps = _check_verify_steps(folder, monkeypatch, prompts, spec, None, tolerance, **kwargs)
    assert max(max(lens) for _, lens in steps) > 8
    for other in DTYPES:
        kwargs = dict(max_query=None, quantization="int4", dtype=other)
        plan = _run(folder, monkeypatch, True, prompts[:1], **kwargs)[1]
        assert plan is not None and plan.grouped == cpu_kernels.uses_cascade(getattr(torch, other))
