"""The MTP proposer (speculative method "mtp"): the target checkpoint's own multi-token-prediction layer
(Qwen3-Next's ``mtp.*``, `models/qwen3_next_mtp.py`; DeepSeek V3's layer ``num_hidden_layers``,
`models/deepseek_mtp.py`) drafts each decoding request's next k tokens (vLLM's EAGLE / MTP shape).

The MTP's attention layer is a cache layer of the target's pool: its spec (the target's KV heads and
head size, so the target's attention pages) joins the specs under the prefix ``mtp.`` and lands in a
full-attention KV-cache group like the target's; hybrid targets are fine, since it keeps no recurrent
state. Two invariants make its K/V exact, the ones `DraftModel` keeps:

- Every position the target computes, the MTP computes too (`run_step`, after the step's sampling or
  verification): position i gets the target's hidden state h_i and token t_{i+1}, the step's input ids
  shifted by one, each request's last position taking the token just sampled (or, after verification, the
  token after the last accepted draft). Prompts, chunks, prefix hits, forks and recomputation after a
  preemption serve it as they serve the target; positions after a rejection are rewritten later, as the
  target's are. The prefix hit is cut one boundary back (`KVCacheManager.hit_needs_next_token`) so the
  token after the reused prefix matched too.
- Proposing (`propose`) takes the MTP output of each decoding request (N tokens, the last one just
  sampled) at its last computed position N - 2, whose logits give draft 1; draft j > 1 re-runs the layer
  on its own output and draft j - 1 at position N + j - 3, slots the scheduler reserved ahead
  (`SpeculativeConfig.lookahead_slots`: k - 1), rewritten when the next step computes those positions.

Greedy requests draft the argmax; sampling requests draw from q = softmax(logits / temperature) and keep
q for the rejection sampler (`draft_model.draw_draft`), so the output is distributed as the target's.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from tokenos.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec
from tokenos.core.spec_decode import SpeculativeConfig
from tokenos.layers.metadata import ForwardBatch
from tokenos.model_loader import load_weights
from tokenos.model_loader.safetensors_loader import iter_safetensors_weights, safetensors_names
from tokenos.models.build import pack_for_inference
from tokenos.models.config import ModelConfig
from tokenos.models.deepseek_mtp import DeepseekMTP
from tokenos.models.qwen3_next_mtp import MTP_PREFIX, Qwen3NextMTP
from tokenos.worker.draft_model import PoolDrafter, draft_capacity, draw_draft, one_token_metadata
from tokenos.worker.input_batch import InputBatch
from tokenos.worker.step_inputs import StepInputs

# Architectures whose MTP layer is built here, and its module.
MTP_MODELS: dict[str, type[Qwen3NextMTP] | type[DeepseekMTP]] = {
    "Qwen3NextForCausalLM": Qwen3NextMTP,
    "DeepseekV3ForCausalLM": DeepseekMTP,
}


class MtpDrafter(PoolDrafter):
    prefix = MTP_PREFIX

    def __init__(self, target_config: ModelConfig, spec: SpeculativeConfig, target: nn.Module) -> None:
        check_mtp_target(target_config)
        super().__init__(spec)
        self.model = build_mtp(target_config, target)

    def get_kv_cache_spec(self, cache_config) -> dict[str, KVCacheSpec]:
        specs = self.model.get_kv_cache_spec(cache_config)
        assert all(isinstance(s, FullAttentionSpec) for s in specs.values())  # MLA's included
        return {self.prefix + name: spec for name, spec in specs.items()}

    def run_step(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        hidden: torch.Tensor,
        forward_batch: ForwardBatch,
        kv_caches: list,
    ) -> torch.Tensor:
        """The MTP over the step's flat batch, after its tokens were appended: position i of row r reads
        h_i and ``batch.token_ids[r, i + 1]``. Writes its K/V at every scheduled position; returns its
        output hidden states ``[T, hidden]``."""
        width = batch.token_ids.shape[1]
        # A position at the very end of the context has no next token; its output is never used.
        next_ids = batch.token_ids[inputs.rows, np.minimum(inputs.positions + 1, width - 1)]
        start = len(forward_batch.kv_caches) - self.num_entries
        step = ForwardBatch(
            torch.from_numpy(next_ids), forward_batch.positions, kv_caches, forward_batch.metadata[start:]
        )
        return self.model(step.input_ids, step.positions, hidden, step)

    @torch.no_grad()
    def propose(
        self,
        batch: InputBatch,
        rows: list[int],
        inputs: StepInputs,
        out: torch.Tensor,
        kv_caches: list,
        max_model_len: int,
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Drafts for batch ``rows`` (requests that just sampled) from `run_step`'s output ``out``: row ->
        up to k draft ids, and for sampling rows row -> q, [drafts, vocab] float32."""
        last = batch.num_tokens[rows].astype(np.int64) - 1  # the token just sampled, not yet computed
        # Draft 1 needs no slot; draft j > 1 writes position last + j - 2 within the reserved slots, and
        # the drafts leave room for the token after them.
        capacity = draft_capacity(batch, rows, self.block_sizes)
        want = np.minimum(np.minimum(capacity - last + 1, max_model_len - last - 2), self.k).clip(min=0)
        index = inputs.query_start[rows] + (last - 1 - inputs.num_computed[rows])
        hidden = out[torch.from_numpy(index)]
        tokens = np.zeros(len(rows), dtype=np.int64)
        drafts: dict[int, list[int]] = {r: [] for r in rows}
        probs: dict[int, list[torch.Tensor]] = {}
        live = np.flatnonzero(want > 0)
        logits = self.model.compute_logits(hidden[torch.from_numpy(live)]).float()
        for j in range(int(want.max(initial=0))):
            if j:  # one more MTP token: its own last output and draft j at position last + j - 1
                live = np.flatnonzero(want > j)
                live_rows = [rows[i] for i in live]
                positions = last[live] + j - 1
                step = ForwardBatch(
                    torch.from_numpy(tokens[live]),
                    torch.from_numpy(positions),
                    kv_caches,
                    one_token_metadata(batch, live_rows, positions, self.block_sizes, self.entry_groups),
                )
                h = self.model(step.input_ids, step.positions, hidden[torch.from_numpy(live)], step)
                hidden[torch.from_numpy(live)] = h
                logits = self.model.compute_logits(h).float()
            for i, row_logits in zip(live, logits, strict=True):
                row = rows[i]
                tok, q = draw_draft(batch, row, row_logits, int(last[i]) + j, self.generator)
                drafts[row].append(tok)
                tokens[i] = tok
                if q is not None:
                    probs.setdefault(row, []).append(q)
        return drafts, {r: torch.stack(qs) for r, qs in probs.items()}


def check_mtp_target(config: ModelConfig) -> None:
    """Refuse a target whose MTP layer is not built here or whose checkpoint carries none."""
    cls = MTP_MODELS.get(config.architecture)
    if cls is None or config.model_impl != "tokenos":
        raise ValueError(
            f'speculative method "mtp" is built for {list(MTP_MODELS)} (native code) only; '
            f"{config.architecture} ({config.model_impl} implementation) has no MTP layer here."
        )
    if config.gguf_file or not os.path.isdir(config.model_path):
        raise ValueError('speculative method "mtp" needs a safetensors checkpoint folder with MTP weights.')
    prefix = cls.weight_prefix(config)
    layers = cls.num_layers(config, [n for n in safetensors_names(config.model_path) if n.startswith(prefix)])
    if not layers:
        raise ValueError(
            f"the checkpoint {config.model_path!r} has no multi-token-prediction weights ({prefix}*): "
            'speculative method "mtp" needs them; use "ngram" or "suffix" instead.'
        )
    if layers != 1:
        raise ValueError(f"the checkpoint has {layers} MTP layers; only one is built.")


def build_mtp(config: ModelConfig, target: nn.Module) -> Qwen3NextMTP | DeepseekMTP:
    """The MTP module over ``target``'s shared parts (embeddings, rotary, for Qwen3-Next the LM head),
    its own weights loaded from the target's checkpoint."""
    cls = MTP_MODELS[config.architecture]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        mtp = cls.for_target(config, target)
    finally:
        torch.set_default_dtype(previous)
    prefix = cls.weight_prefix(config)
    if config.quantization in ("gptq", "awq"):
        from tokenos.model_loader import iter_checkpoint_weights

        stream = (item for item in iter_checkpoint_weights(config) if item[0].startswith(prefix))
    else:
        stream = iter_safetensors_weights(config.model_path, prefix)
    renamed = ((cls.checkpoint_name(name[len(prefix) :]), t) for name, t in stream)
    load_weights(mtp, config, ((name, t) for name, t in renamed if name is not None))
    pack_for_inference(mtp, config.quantization)
    return mtp.eval()
