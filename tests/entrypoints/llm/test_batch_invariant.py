"""Batch invariance end to end (``TOKENOS_BATCH_INVARIANT=1``): greedy speculative decoding gives plain
decoding's tokens on a quantized model in the CPU's own dtype (bf16 where native), at any batch size,
where by default a near-tie can go the other way once a token is computed among a verify's rows instead
of alone; and a model the mode cannot hold for is refused at start-up, never run without it."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import save_tiny
from tests.fixtures.kernels import batch_invariant
from tests.fixtures.llm import DENSE, make_llm
from tests.fixtures.tokenizers import HAS_SMOLLM2, NO_SMOLLM2
from tokenos import SamplingParams
from tokenos.layers import cpu_kernels
from tokenos.platform import native_bf16_supported

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C kernels (no compiler)")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# Every query through the C prefill kernel: bf16 on a CPU with AVX512-BF16 (the embedded model's heads).
BF16_PREFILL_KERNEL = native_bf16_supported() and cpu_kernels.prefill_supported(9, 3, 64)

PASSAGES = [
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and watched "
    "the ships pass safely through the narrow channel below.",
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result "
    "in descending order.",
    "Rivers carve their valleys over thousands of years, carrying sand and stones from the mountains to "
    "the sea, where the currents spread them along the coast.",
    "Open the file and return a corresponding file object. If the file cannot be opened, an error is "
    "raised. The mode is an optional string that specifies the mode in which the file is opened.",
]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason=NO_SMOLLM2)
@pytest.mark.skipif(not BF16_PREFILL_KERNEL, reason="prompt chunks attend through torch SDPA here")
def test_speculation_gives_plain_greedy_tokens_on_the_embedded_model():
    """The embedded SmolLM2 (Q4_1) asked to repeat passages, in the dtype "auto" picks: plain decoding
    one request at a time, then with n-gram drafts one at a time and all at once, token for token."""
    from tokenos import LLM

    messages = [[{"role": "user", "content": f"Repeat the following text exactly:\n{p}"}] for p in PASSAGES]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runs = {}
    with batch_invariant():
        for name, spec, seqs in (("plain", None, 1), ("spec", NGRAM, 1), ("spec, batched", NGRAM, 4)):
            llm = LLM(max_model_len=512, max_num_seqs=seqs, speculative_config=spec)
            runs[name] = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
            if spec:
                assert llm.get_metrics()["spec_decoding"]["num_accepted_tokens"] > 0
    assert runs["spec"] == runs["plain"]
    assert runs["spec, batched"] == runs["plain"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason=NO_SMOLLM2)
@pytest.mark.skipif(not BF16_PREFILL_KERNEL, reason="prompt chunks attend through torch SDPA here")
def test_every_scheduling_path_gives_the_same_tokens_on_the_embedded_model():
    """Where every query attends through the C prefill kernel (bf16 on AVX512-BF16), the tokens do not
    depend on the schedule at all: chunked prefill, prefix hits (a prompt twice), preemption by
    recompute, n = 2, each with and without n-gram drafts, equal one request alone."""
    from tokenos import LLM

    messages = [[{"role": "user", "content": f"Repeat the following text exactly:\n{p}"}] for p in PASSAGES]
    messages.append(messages[0])  # the second copy hits the first's pages
    small = {"num_kv_blocks": 20, "enable_prefix_caching": False}  # 320 tokens for 5 of ~130: preempts
    variants = [
        ("alone", {"max_num_seqs": 1}, 1),
        ("chunked", {"max_num_batched_tokens": 48}, 1),
        ("preempted", small, 1),
        ("n=2", {}, 2),
    ]
    want = None
    with batch_invariant():
        for name, kwargs, n in variants:
            for spec in (None, NGRAM):
                llm = LLM(dtype="bfloat16", max_model_len=256, speculative_config=spec, **kwargs)
                params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, n=n)
                outs = llm.chat(messages, params, use_tqdm=False)
                got = [[c.token_ids for c in o.outputs] for o in outs]
                want = want or [[c[0]] * n for c in got]
                assert got == [[w[0]] * n for w in want], (name, spec)
                if name == "preempted":
                    assert llm.get_metrics()["num_preemptions"] > 0


def test_speculation_on_an_online_quantized_tiny_model_keeps_plain_tokens(tiny_llama):
    """fp32 rows through the quantized kernel (int8 online): batched speculation, plain decoding."""
    folder, _ = tiny_llama
    prompts = [p * 3 for p in DENSE.prompts(4, 4, 12, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    with batch_invariant():
        for spec in (None, {**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 3}):
            llm = make_llm(folder, quantization="int8", speculative_config=spec)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_a_model_with_dense_linears_is_refused(tiny_llama):
    """Dense weights run torch's GEMM, whose sums depend on the row count: refused, saying what to do."""
    folder, _ = tiny_llama
    with batch_invariant(), pytest.raises(ValueError, match="TOKENOS_BATCH_INVARIANT=1 needs every linear"):
        make_llm(folder)


def test_a_model_it_is_not_built_for_is_refused(tmp_path):
    """A hybrid (a recurrent mixer beside attention), even with every linear quantized: refused by name."""
    folder = str(tmp_path / "bamba")
    save_tiny("bamba", folder)
    with batch_invariant(), pytest.raises(ValueError, match="Mamba2Mixer"):
        make_llm(folder, quantization="int8")
