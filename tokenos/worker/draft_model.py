"""The draft-model proposer (speculative method "draft_model"): a small model of the target's vocabulary
that guesses each decoding request's next k tokens, verified by the target in the next step.

Its attention layers are cache layers of the same pool: their specs join the target's under the
prefix ``drafter.`` (`get_kv_cache_spec`), so pool sizing counts their bytes and the blocks the scheduler
allocates cover them (layers with the target's page shape join its KV-cache group, as vLLM's draft
layers do; a drafter whose pages differ from the target's is refused). Two invariants make it exact:

- Every position the target computes is computed by the drafter too, in the same step over the same
  flat batch (`run_step`): prompts, chunks, verified drafts. So a computed position's drafter K/V always
  holds the real token's, and prefix hits, forks and recomputation after a preemption serve the drafter
  as they serve the target. Rejected positions are rewritten later, as the target's are.
- Proposing (`propose`) runs k one-token forwards over every request that just sampled: the first at
  its last token (position P), draft j at P + j. The scheduler reserved those slots ahead
  (`Scheduler.num_lookahead`); the drafts are verified (hence rewritten) by the next step.

Greedy requests draft the drafter's argmax. Sampling requests draft from q = softmax(drafter logits /
temperature) and keep q, so the rejection sampler's min(1, p/q) test and max(p - q, 0) residual make
the output distributed as the target's whatever q is. A seeded request's draft draws come from a
generator seeded by (its seed, the position), so its output does not depend on what else runs.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tokenos.core.kv_cache.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec
from tokenos.core.spec_decode import SpeculativeConfig
from tokenos.layers.attention_metadata import AttentionMetadata, make_attention_metadata
from tokenos.layers.metadata import ForwardBatch
from tokenos.models import build_model
from tokenos.models.config import ModelConfig, load_model_config
from tokenos.worker.input_batch import InputBatch
from tokenos.worker.step_inputs import slot_mapping

PREFIX = "drafter."
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) over the generator's seed space


class PoolDrafter:
    """What a worker drafter whose attention pages are entries of the target's pool keeps: k, the batch
    size past which it drafts nothing, its draw generator, and (after `bind`) its entries' groups."""

    prefix: str

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.k = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.generator = torch.Generator().manual_seed(0)
        self.num_entries = 0
        self.entry_groups: list[int] = []
        self.block_sizes: dict[int, int] = {}

    def bind(self, entry_groups: list[int], block_sizes: dict[int, int]) -> None:
        """The drafter's pool entries' KV-cache groups (in its layer order) and those groups' block sizes."""
        self.num_entries = len(entry_groups)
        self.entry_groups = entry_groups
        self.block_sizes = block_sizes


class DraftModel(PoolDrafter):
    prefix = PREFIX

    def __init__(self, target: ModelConfig, spec: SpeculativeConfig) -> None:
        if target.model_impl != "tokenos":
            raise ValueError(
                'speculative method "draft_model" needs a target with native tokenos code; '
                f"{target.architecture} runs on the transformers backend."
            )
        super().__init__(spec)
        self.config = load_model_config(spec.model, dtype=target.dtype, max_model_len=target.max_model_len)
        check_drafter(target, self.config)
        self.model = build_model(self.config)

    def get_kv_cache_spec(self, cache_config) -> dict[str, KVCacheSpec]:
        specs = self.model.get_kv_cache_spec(cache_config)
        for name, spec in specs.items():
            if type(spec) is not FullAttentionSpec:
                raise ValueError(
                    f"the drafter's layer {name} needs a {type(spec).__name__}: hybrid or sliding-window "
                    "drafters are not built yet; use a full-attention drafter."
                )
        return {PREFIX + name: spec for name, spec in specs.items()}

    def run_step(self, batch: ForwardBatch, kv_caches: list) -> None:
        """The drafter over the step's flat batch, with its own pool entries: its K/V for every token the
        target computes this step (its logits are not needed)."""
        start = len(batch.kv_caches) - self.num_entries
        self.model(ForwardBatch(batch.input_ids, batch.positions, kv_caches, batch.metadata[start:]))

    @torch.no_grad()
    def propose(
        self, batch: InputBatch, rows: list[int], kv_caches: list, max_model_len: int
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Drafts for batch ``rows`` (requests whose every token but the last is computed): row -> up to k
        draft ids, and for sampling rows row -> q, [drafts, vocab] float32."""
        last = batch.num_tokens[rows].astype(np.int64) - 1
        # Within the slots reserved ahead, and leaving room for the token after the drafts.
        capacity = draft_capacity(batch, rows, self.block_sizes)
        want = np.minimum(np.minimum(capacity - last, max_model_len - last - 2), self.k).clip(min=0)
        drafts: dict[int, list[int]] = {r: [] for r in rows}
        probs: dict[int, list[torch.Tensor]] = {}
        tokens = batch.token_ids[rows, last].copy()
        for j in range(int(want.max(initial=0))):
            live = np.flatnonzero(want > j)
            live_rows = [rows[i] for i in live]
            positions = last[live] + j
            logits = self._forward(batch, live_rows, tokens[live], positions, kv_caches)
            for i, row, row_logits, pos in zip(live, live_rows, logits, positions, strict=True):
                tok, q = self._draw(batch, row, row_logits, int(pos))
                drafts[row].append(tok)
                tokens[i] = tok
                if q is not None:
                    probs.setdefault(row, []).append(q)
        return drafts, {r: torch.stack(qs) for r, qs in probs.items()}

    def _forward(
        self,
        batch: InputBatch,
        rows: list[int],
        tokens: np.ndarray,
        positions: np.ndarray,
        kv_caches: list,
    ) -> torch.Tensor:
        """One token per row at ``positions``: writes its K/V, returns the logits [rows, vocab]."""
        step = ForwardBatch(
            torch.from_numpy(tokens.astype(np.int64)),
            torch.from_numpy(positions.astype(np.int64)),
            kv_caches,
            one_token_metadata(batch, rows, positions, self.block_sizes, self.entry_groups),
        )
        return self.model.compute_logits(self.model(step)).float()

    def _draw(
        self, batch: InputBatch, row: int, logits: torch.Tensor, position: int
    ) -> tuple[int, torch.Tensor | None]:
        return draw_draft(batch, row, logits, position, self.generator)


def one_token_metadata(
    batch: InputBatch,
    rows: list[int],
    positions: np.ndarray,
    block_sizes: dict[int, int],
    entry_groups: list[int],
) -> list[AttentionMetadata]:
    """Per drafter entry, the attention metadata of one token per batch row at ``positions`` (its slot
    in the row's own pages: a drafter's proposing forwards)."""
    local = np.arange(len(rows))
    metadata: dict[int, AttentionMetadata] = {}
    for g, block_size in block_sizes.items():
        table = batch.block_tables[g]
        width = max(int(table.num_blocks[rows].max()), 1)
        block_table = np.ascontiguousarray(table.table[rows, :width])
        slots = slot_mapping(block_table, local, positions, block_size)
        metadata[g] = make_attention_metadata(
            torch.from_numpy(block_table),
            [1] * len(rows),
            (positions + 1).tolist(),
            torch.from_numpy(slots),
            block_size,
        )
    return [metadata[g] for g in entry_groups]


def draft_capacity(batch: InputBatch, rows: list[int], block_sizes: dict[int, int]) -> np.ndarray:
    """Slots each row's pages hold in every drafter group (drafts write K/V no further)."""
    return np.minimum.reduce(
        [batch.block_tables[g].num_blocks[rows].astype(np.int64) * b for g, b in block_sizes.items()]
    )


def draw_draft(
    batch: InputBatch, row: int, logits: torch.Tensor, position: int, generator: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """The drafter's token at ``row`` (its argmax for greedy requests, else a draw from q) and q."""
    sampling = batch.sampling
    if sampling.is_greedy[row]:
        return int(logits.argmax()), None
    q = torch.softmax(logits / float(sampling.temperature[row]), dim=-1)
    seeded = sampling.generators[row]
    if seeded is not None:  # a request's own stream: (its seed, this position)
        gen = torch.Generator().manual_seed((seeded.initial_seed() * _SEED_MIX + position) % 2**63)
    else:
        gen = generator
    return int(torch.multinomial(q, 1, generator=gen)), q


def drafter_specs(
    target: dict[str, KVCacheSpec], drafter: dict[str, KVCacheSpec], hybrid_ok: bool = False
) -> dict[str, KVCacheSpec]:
    """The drafter's specs, refused where its pages cannot share the target's pool exactly: a hybrid
    (recurrent-state) target (unless ``hybrid_ok``: the MTP layer, whose one attention layer has the
    target's attention pages), or attention pages of another shape than the target's."""
    if not hybrid_ok and any(isinstance(s, MambaSpec) for s in target.values()):
        raise ValueError(
            'speculative method "draft_model" on hybrid (recurrent-state) models is not built yet: '
            "serve this model without speculative_config."
        )
    shapes = {(s.block_size, s.bytes_per_token) for s in target.values() if isinstance(s, AttentionSpec)}
    for name, spec in drafter.items():
        if (spec.block_size, spec.bytes_per_token) not in shapes:
            raise ValueError(
                f"the drafter's layer {name} stores {spec.bytes_per_token} KV bytes per token "
                f"({spec.num_kv_heads} KV heads of {spec.head_size}), the target "
                f"{sorted(b for _, b in shapes)}: drafter pages of another size cannot share the pool "
                "yet. Use a drafter with the target's KV heads and head size."
            )
    return drafter


def check_drafter(target: ModelConfig, drafter: ModelConfig) -> None:
    """Refuse a drafter whose tokens are not the target's (its drafts would mean other text)."""
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"the drafter {drafter.model_path!r} has a vocabulary of {drafter.vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft model must share the target's tokenizer."
        )
    if drafter.model_impl != "tokenos":
        raise ValueError(
            f"the drafter's architecture {drafter.architecture} has no native tokenos code; "
            "use a drafter of a natively supported family."
        )
    ours, theirs = _vocab(target.model_dir), _vocab(drafter.model_dir)
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(
            f"the drafter {drafter.model_path!r} has the target's vocabulary size but another tokenizer "
            "(its token strings differ): use a drafter trained with the target's tokenizer."
        )


def _vocab(folder: str) -> dict[str, int] | None:
    """The token -> id table of the HF tokenizer saved in ``folder``, or None where there is none."""
    from tokenos.engine.tokenizer import _has_hf_tokenizer_files, load_tokenizer

    if not os.path.isdir(folder) or not _has_hf_tokenizer_files(folder):
        return None
    return load_tokenizer(folder).hf.get_vocab()
