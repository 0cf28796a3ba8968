"""Speculative method "mtp" through `LLM`: Qwen3-Next's own multi-token-prediction layer drafts.

The drafts themselves are checked against a dense reference written here in plain torch (no pages, the
whole sequence at once, fed transformers' target hidden states): every proposal the engine makes, after
prefill chunks, prefix hits, verification steps that accepted or rejected drafts, equals the reference's
for the request's tokens at that moment (greedy: the argmax; sampling: q itself), so a wrong shift,
concatenation order, norm or K/V position fails. Greedy output is token for token the output without
speculation under every scheduling path; a random MTP layer is rarely right, so the acceptance paths are
exercised by seeded sampling at a high temperature (where p and q are both near uniform).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures.checkpoints import save_qwen3_next_mtp, save_tiny
from tests.fixtures.llm import HYBRID, make_llm, preemption_workload
from tokenos import SamplingParams

FAST = dict(num_kv_blocks=600)


def mtp_config(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """(folder, transformers model): the tiny Qwen3-Next with random mtp.* weights."""
    folder = str(tmp_path_factory.mktemp("qwen3_next_mtp"))
    return folder, save_qwen3_next_mtp(folder)


class DenseMTP:
    """The MTP layer's arithmetic over a whole sequence in plain float32 torch, from the checkpoint's
    tensors: x_i = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)]), one causal gated-attention + MoE decoder
    layer with rope at i, the final norm, the target's LM head."""

    def __init__(self, folder: str, ref) -> None:
        from safetensors.torch import load_file

        self.w = {
            k[4:]: v.float() for k, v in load_file(f"{folder}/model.safetensors").items() if k[:4] == "mtp."
        }
        self.ref = ref
        self.cache: list[tuple[list[int], torch.Tensor]] = []
        cfg = ref.config
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        rope = cfg.rope_parameters
        self.rot = int(cfg.head_dim * rope["partial_rotary_factor"])
        self.inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, self.rot, 2).float() / self.rot)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.w[name])

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None].float() * self.inv_freq[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        r, rest = x[..., : self.rot], x[..., self.rot :]
        half = self.rot // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
        return torch.cat([r * cos + rotated * sin, rest], -1)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, "layers.0.self_attn."
        n, heads, kv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, gate = (x @ w[p + "q_proj.weight"].T).view(n, heads, 2 * hd).chunk(2, -1)
        k = (x @ w[p + "k_proj.weight"].T).view(n, kv, hd)
        v = (x @ w[p + "v_proj.weight"].T).view(n, kv, hd)
        pos = torch.arange(n)
        q, k = (
            self.rope(self.norm(q, p + "q_norm.weight"), pos),
            self.rope(self.norm(k, p + "k_norm.weight"), pos),
        )
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
        return (out * torch.sigmoid(gate.reshape(n, -1))) @ w[p + "o_proj.weight"].T

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[
            p + "down_proj.weight"
        ].T

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, "layers.0.mlp."
        weights, chosen = torch.topk(
            (x @ w[p + "gate.weight"].T).softmax(-1), self.cfg.num_experts_per_tok, -1
        )
        weights = weights / weights.sum(-1, keepdim=True)  # norm_topk_prob
        out = torch.zeros_like(x)
        for e in range(self.cfg.num_experts):
            share = (weights * (chosen == e)).sum(-1, keepdim=True)
            out += share * self.mlp(x, f"{p}experts.{e}.")
        return out + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * self.mlp(
            x, p + "shared_expert."
        )

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm(x, "layers.0.input_layernorm.weight"))
        return self.norm(
            x + self.moe(self.norm(x, "layers.0.post_attention_layernorm.weight")), "norm.weight"
        )

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """transformers' hidden states after the final norm at every position of ``tokens``: one forward
        per request (the longest token list asked first), sliced for its earlier proposals (causal)."""
        for seq, hidden in self.cache:
            if seq[: len(tokens)] == tokens:
                return hidden[: len(tokens)]
        hidden = self.ref.model(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
        self.cache.append((tokens, hidden.float()))
        return self.cache[-1][1]

    @torch.no_grad()
    def draft_logits(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """The MTP's logits for each draft of a request whose tokens are ``tokens`` (the last one just
        sampled): draft 1 from h_{N-2} and t_{N-1}, draft j > 1 from the MTP's own output and draft j - 1."""
        hidden = self.target_hidden(tokens[:-1])
        embed, head = self.ref.model.embed_tokens, self.ref.lm_head
        inputs = list(tokens[1:])
        out: list[torch.Tensor] = []
        for j in range(len(drafts)):
            e = self.norm(embed(torch.tensor(inputs)).float(), "pre_fc_norm_embedding.weight")
            x = torch.cat([e, self.norm(hidden, "pre_fc_norm_hidden.weight")], -1) @ self.w["fc.weight"].T
            last = self.layer(x)[-1]
            out.append(head(last).float())
            hidden = torch.cat([hidden, last[None]])  # its own output, beside draft j + 1's token
            inputs.append(drafts[j])
        return out


def record_proposals(llm) -> list[tuple[list[int], list[int], torch.Tensor | None]]:
    """Every proposal the engine's MTP makes: (the request's tokens then, its drafts, q or None)."""
    drafter = llm.engine.model_runner.drafter
    seen: list[tuple[list[int], list[int], torch.Tensor | None]] = []
    propose = drafter.propose

    def wrapped(batch, rows, *args):
        drafts, probs = propose(batch, rows, *args)
        for row in rows:
            tokens = batch.token_ids[row, : batch.num_tokens[row]].tolist()
            seen.append((tokens, drafts[row], probs.get(row)))
        return drafts, probs

    drafter.propose = wrapped
    return seen


def greedy(llm, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in HYBRID.run(llm, prompts, n=n)]


def spec_stats(llm) -> dict:
    return llm.get_metrics()["spec_decoding"]


def shared_prefix_prompts() -> list[list[int]]:
    """Prompts sharing a 40-token prefix (prefix hits for the later ones), one leaving it at token 32 (a
    checkpoint boundary whose next token differs from the cached request's), and unrelated ones."""
    shared = HYBRID.prompts(1, 40, 40, seed=7)[0]
    fork_at_32 = shared[:32] + [(t + 1) % 61 + 3 for t in shared[32:40]]
    return (
        [shared + p for p in HYBRID.prompts(3, 3, 9, seed=8)]
        + [fork_at_32]
        + HYBRID.prompts(2, 5, 30, seed=9)
    )


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_proposals_equal_the_dense_reference(mtp_model, k):
    """Chunked prefill (7 tokens a step) and prefix hits: each proposal is the reference's argmax."""
    folder, ref = mtp_model
    dense = DenseMTP(folder, ref)
    llm = make_llm(folder, speculative_config=mtp_config(k), max_num_batched_tokens=7, **FAST)
    seen = record_proposals(llm)
    prompts = shared_prefix_prompts()
    greedy(llm, prompts[:1])  # the shared prefix is cached before the others arrive
    greedy(llm, prompts[1:])
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    assert len(seen) > 30 and any(len(d) == k for _, d, _ in seen)
    for tokens, drafts, _ in sorted(seen, key=lambda s: -len(s[0])):
        want = [int(lg.argmax()) for lg in dense.draft_logits(tokens, drafts)]
        assert drafts == want, f"request of {len(tokens)} tokens"


def test_sampled_proposals_draw_from_the_dense_reference_q(mtp_model):
    """Seeded sampling at temperature 4 under chunked prefill (7 tokens a step) and prefix hits: drafts
    are mostly accepted (so proposals follow verification steps that kept 1 and 2 drafts; the greedy
    test's random drafts are rejected), and each
    q is softmax(reference logits / temperature), which shows even a slightly wrong K/V (the one after a
    reused prefix written with another request's next token, say)."""
    folder, ref = mtp_model
    dense = DenseMTP(folder, ref)
    llm = make_llm(folder, speculative_config=mtp_config(2), max_num_batched_tokens=7, **FAST)
    seen = record_proposals(llm)
    params = SamplingParams(temperature=4.0, seed=3, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts()[:4]
    for batch in (prompts[:1], prompts[1:]):  # the shared prefix is cached before the others arrive
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    stats = spec_stats(llm)
    assert stats["accepted_per_pos"][1] > 0, stats  # proposals after steps that kept both drafts
    for tokens, drafts, q in sorted(seen, key=lambda s: -len(s[0])):
        want = torch.stack([torch.softmax(lg / 4.0, -1) for lg in dense.draft_logits(tokens, drafts)])
        torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)


def test_kv_written_while_the_batch_is_too_large_to_draft_serves_later_drafts(mtp_model):
    """With more running requests than disable_by_batch_size no drafts are made, but the MTP still writes
    its K/V for every computed position: once the short requests finish, the long one drafts over them."""
    folder, ref = mtp_model
    dense = DenseMTP(folder, ref)
    spec = {**mtp_config(2), "disable_by_batch_size": 1}
    llm = make_llm(folder, speculative_config=spec, **FAST)
    seen = record_proposals(llm)
    prompts = HYBRID.prompts(3, 10, 20, seed=11)
    params = [
        SamplingParams(temperature=4.0, seed=i, max_tokens=m, ignore_eos=True)
        for i, m in enumerate((3, 3, 14))
    ]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert seen and min(len(t) for t, _, _ in seen) > len(prompts[2]) + 3  # none while three ran
    for tokens, drafts, q in sorted(seen, key=lambda s: -len(s[0])):
        want = torch.stack([torch.softmax(lg / 4.0, -1) for lg in dense.draft_logits(tokens, drafts)])
        torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def plain_answers(mtp_model):
    """Greedy completions without speculation of the parity prompts (and the preemption workload's)."""
    folder, _ = mtp_model
    need, preempt = preemption_workload(folder, speculative_config=mtp_config(2), **FAST)
    prompts = shared_prefix_prompts()
    answers = {
        tuple(p): o[0] for p, o in zip(prompts, greedy(make_llm(folder, **FAST), prompts), strict=True)
    }
    llm = make_llm(folder, max_model_len=128, **FAST)
    answers.update({tuple(p): o[0] for p, o in zip(preempt, greedy(llm, preempt), strict=True)})
    return answers, need, preempt


SCHEDULES = {
    "mixed": {},
    "chunked5": {"max_num_batched_tokens": 5},  # chunks end on checkpoints: prefix hits
    "all8": {"mamba_cache_mode": "all", "mamba_checkpoint_interval": 8},  # a checkpoint every 8 tokens
    "preempt": None,  # the preemption workload
}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_output_is_the_output_without_speculation(mtp_model, plain_answers, schedule, k):
    """Mixed batches, chunked prefill, prefix hits (the later prompts resume from the first one's
    checkpoints), n = 2 forks and preemption by recompute."""
    folder, _ = mtp_model
    answers, need, preempt = plain_answers
    if schedule == "preempt":
        kwargs = dict(max_model_len=128, num_kv_blocks=need + 1, enable_prefix_caching=False)
        llm = make_llm(folder, speculative_config=mtp_config(k), **kwargs)
        assert greedy(llm, preempt) == [[answers[tuple(p)]] for p in preempt]
        assert llm.get_metrics()["num_preemptions"] > 0
    else:
        llm = make_llm(folder, speculative_config=mtp_config(k), **{**FAST, **SCHEDULES[schedule]})
        prompts = shared_prefix_prompts()
        got = greedy(llm, prompts[:1]) + greedy(llm, prompts[1:], n=2)
        assert got == [[answers[tuple(p)]] * (1 if i == 0 else 2) for i, p in enumerate(prompts)]
        # Align mode checkpoints whole prompts only at their ends unless chunked: the MTP's hit must end
        # one checkpoint before the last matched token (KVCacheManager), so "mixed" has none.
        assert (llm.get_metrics()["prefix_cache_hits"] > 0) == (schedule != "mixed")
    assert spec_stats(llm)["num_draft_tokens"] > 0


def test_drafts_stop_at_the_end_of_the_context(mtp_model):
    """Prompts a few tokens short of max_model_len: drafts are cut where the context ends (k = 3 wants
    two lookahead slots past it), and the output is the output without speculation."""
    folder, _ = mtp_model
    prompts = HYBRID.prompts(3, 36, 44, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outputs = []
    for spec in (None, mtp_config(3)):
        llm = make_llm(folder, max_model_len=48, num_kv_blocks=200, speculative_config=spec)
        outputs.append(
            [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        )
    assert outputs[0] == outputs[1] and spec_stats(llm)["num_draft_tokens"] > 0
    assert [len(p) + len(o) for p, o in zip(prompts, outputs[1], strict=True)] == [48] * 3


def test_seeded_sampling_runs_and_counts_drafts(mtp_model):
    folder, _ = mtp_model
    llm = make_llm(folder, speculative_config=mtp_config(2), **FAST)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, n=2)
    prompts = HYBRID.prompts(2, 5, 15, seed=6)
    runs = [
        [
            [c.token_ids for c in o.outputs]
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]  # seeded: the same output whatever ran before
    stats = spec_stats(llm)
    assert stats["num_draft_tokens"] > 0 and 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert len(stats["accepted_per_pos"]) == 2


def test_mtp_is_refused_where_there_is_no_mtp_layer(mtp_model, tmp_path):
    folder, _ = mtp_model
    plain = str(tmp_path / "qwen3_next")
    save_tiny("qwen3_next", plain)
    with pytest.raises(ValueError, match="no multi-token-prediction weights"):
        make_llm(plain, speculative_config=mtp_config(1), **FAST)
    llama = str(tmp_path / "llama")
    save_tiny("llama", llama)
    with pytest.raises(ValueError, match="is built for"):
        make_llm(llama, speculative_config=mtp_config(1))
    with pytest.raises(ValueError, match="model does not apply"):
        make_llm(folder, speculative_config={**mtp_config(1), "model": folder})
    with pytest.raises(ValueError, match="do not apply"):
        make_llm(folder, speculative_config={**mtp_config(1), "prompt_lookup_max": 3})


def test_mtp_weights_load_only_with_mtp(mtp_model):
    """Without speculation the mtp.* tensors are skipped (the target alone); with it they are loaded."""
    folder, ref = mtp_model
    plain = make_llm(folder, **FAST).engine
    assert plain.model_runner.drafter is None
    assert not any(n.startswith("mtp.") for n in plain.model_runner.get_kv_cache_spec())
    runner = make_llm(folder, speculative_config=mtp_config(1), **FAST).engine.model_runner
    x = torch.randn(3, runner.drafter.model.fc.input_size)
    w = DenseMTP(folder, ref).w["fc.weight"]
    torch.testing.assert_close(runner.drafter.model.fc(x), x @ w.T, atol=1e-5, rtol=1e-5)
    assert "mtp.layers.0.self_attn.attn" in runner.get_kv_cache_spec()
