"""Speculative method "mtp" on DeepSeek V3: its MTP layer (decoder layer ``num_hidden_layers`` with
enorm / hnorm / eh_proj / shared_head) drafts. Each proposal equals a dense reference built from
transformers' pieces (the target's hidden states, its embeddings, and transformers' own decoder layer
holding the MTP block's weights, run over the whole sequence); greedy output is the output without
speculation. See test_mtp.py for the Qwen3-Next layer and the scheduling paths."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import save_deepseek_v3_mtp, save_tiny
from tests.fixtures.llm import make_llm, random_prompts
from tokenos import SamplingParams

FAST = dict(num_kv_blocks=300)
SPEC = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("deepseek_v3_mtp"))
    return folder, *save_deepseek_v3_mtp(folder)


class DenseDeepseekMTP:
    """x_i = eh_proj([enorm(embed(t_{i+1})) (0 at position 0) ; hnorm(h_i)]), transformers' decoder
    layer over the whole sequence (causal SDPA), logits = shared_head.head(shared_head.norm(.))."""

    def __init__(self, folder: str, target, rotary, block) -> None:
        from safetensors.torch import load_file

        prefix = "model.layers.2."
        self.w = {
            k[len(prefix) :]: v
            for k, v in load_file(f"{folder}/model.safetensors").items()
            if k.startswith(prefix)
        }
        self.target, self.rotary, self.block = target, rotary, block
        self.eps = target.config.rms_norm_eps

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    @torch.no_grad()
    def draft_logits(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        ids = torch.tensor([tokens[:-1]])
        hidden = self.target.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        inputs = list(tokens[1:])
        out = []
        for j in range(len(drafts)):
            e = self.target.model.embed_tokens(torch.tensor(inputs))
            e[0] = 0.0  # position 0
            x = torch.cat([self.norm(e, "enorm.weight"), self.norm(hidden, "hnorm.weight")], -1)
            x = (x @ self.w["eh_proj.weight"].T)[None]
            pos = torch.arange(x.shape[1])[None]
            y = self.block(x, position_ids=pos, position_embeddings=self.rotary(x, pos), attention_mask=None)
            last = (y[0] if isinstance(y, tuple) else y)[0, -1]
            out.append(self.norm(last, "shared_head.norm.weight") @ self.w["shared_head.head.weight"].T)
            hidden = torch.cat([hidden, last[None]])
            inputs.append(drafts[j])
        return out


def record(llm) -> list:
    drafter = llm.engine.model_runner.drafter
    seen, propose = [], drafter.propose

    def wrapped(batch, rows, *args):
        drafts, probs = propose(batch, rows, *args)
        seen.extend(
            (batch.token_ids[r, : batch.num_tokens[r]].tolist(), drafts[r], probs.get(r)) for r in rows
        )
        return drafts, probs

    drafter.propose = wrapped
    return seen


def prompts_of(target) -> list[list[int]]:
    vocab = target.config.vocab_size
    shared = random_prompts(1, 36, 36, 7, vocab)[0]
    return [shared + p for p in random_prompts(3, 3, 9, 8, vocab)] + random_prompts(2, 5, 20, 9, vocab)


def test_sampled_proposals_draw_from_the_dense_reference_q(deepseek_mtp):
    """Temperature 4 (drafts mostly accepted), chunked prefill and prefix hits."""
    folder, target, rotary, block = deepseek_mtp
    dense = DenseDeepseekMTP(folder, target, rotary, block)
    llm = make_llm(folder, speculative_config=SPEC, max_num_batched_tokens=7, **FAST)
    seen = record(llm)
    prompts = prompts_of(target)
    params = SamplingParams(temperature=4.0, seed=3, max_tokens=10, ignore_eos=True)
    for batch in (prompts[:1], prompts[1:]):
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    assert llm.get_metrics()["spec_decoding"]["accepted_per_pos"][1] > 0 and len(seen) > 10
    for tokens, drafts, q in seen:
        want = torch.stack([torch.softmax(lg / 4.0, -1) for lg in dense.draft_logits(tokens, drafts)])
        torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 5}], ids=["mixed", "chunked5"])
def test_greedy_output_is_the_output_without_speculation(deepseek_mtp, kwargs):
    folder, target, _, _ = deepseek_mtp
    prompts = prompts_of(target)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    outputs = []
    for spec in (None, SPEC):
        llm = make_llm(folder, speculative_config=spec, **FAST, **kwargs)
        outputs.append(
            [
                [c.token_ids for c in o.outputs]
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ]
        )
    assert outputs[0] == outputs[1] and llm.get_metrics()["spec_decoding"]["num_draft_tokens"] > 0


def test_a_deepseek_checkpoint_without_mtp_tensors_is_refused(tmp_path):
    folder = str(tmp_path / "deepseek_v3")
    save_tiny("deepseek_v3", folder)  # num_nextn_predict_layers 1, but no model.layers.2.* tensors
    with pytest.raises(ValueError, match="no multi-token-prediction weights"):
        make_llm(folder, speculative_config=SPEC, **FAST)
