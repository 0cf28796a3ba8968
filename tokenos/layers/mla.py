"""Multi-head latent attention (DeepSeek V2 / V3) over a paged cache of latents.

MLA caches ONE row per token: the compressed latent ``c`` (``kv_lora_rank`` values, after
``kv_a_layernorm``) followed by the rotated rope key ``k_pe`` (``qk_rope_head_dim`` values), shared by
every query head (`MLAAttentionSpec`). Per head h the keys and values are ``k_h = [W_UK[h] c ; k_pe]``
and ``v_h = W_UV[h] c``, where ``kv_b_proj``'s weight stacks ``W_UK[h]`` [qk_nope, R] and ``W_UV[h]``
[v_head, R] head after head. Two ways to attend over the same pages:

- expanded (prefill chunks, and the reference): every cached latent of the sequence, a cached prefix
  included, goes through ``kv_b_proj`` into per-head K and V; then ordinary causal attention, which is
  what transformers computes;
- absorbed (decodes): ``q_nope_h . k_nope_h = (W_UK[h]^T q_nope_h) . c``, so the query is moved into the
  latent space once and the scores read ``c`` and ``k_pe`` straight from the pages; the output is the
  probability-weighted latent, taken through ``W_UV[h]`` once per head. A decode then never expands the
  context (R + rope values per cached token, instead of heads x (qk + v)).

Cache layout: ``[num_blocks, block_size, 1, R + rope]`` with the block outermost; viewed flat as rows,
token ``offset`` of block ``b`` is row ``b * rows_per_block + offset`` (``rows_per_block`` exceeds
``block_size`` only when a hybrid pool pads pages). The attention itself is plain torch in float32 (scores,
mask, softmax, P V), the arithmetic of transformers' eager float32 path; 8-bit pages are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.core.kv_cache.spec import MLAAttentionSpec
from tokenos.layers.attention import page_rows
from tokenos.layers.attention_metadata import AttentionMetadata
from tokenos.layers.metadata import CacheLayer, ForwardBatch
from tokenos.platform import kv_cache_dtype_name

if TYPE_CHECKING:
    from tokenos.config import CacheConfig


def flat_latent_view(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pages as rows [*, R + rope], and how many rows apart blocks start (padded hybrid pages)."""
    return page_rows(cache, 1)


def latent_rows(slots: torch.Tensor, block_size: int, rows_per_block: int) -> torch.Tensor:
    """Flat rows of ``slots`` (block id * block_size + offset)."""
    return (slots // block_size) * rows_per_block + slots % block_size


class MLAAttention(CacheLayer):
    """The paged part of MLA: given this step's queries (rope applied), normed latents and rotated rope
    keys, write the cache rows and attend. ``kv_b_proj`` is the parent's module (it loads under the
    parent's checkpoint name); ``absorb`` False runs decodes expanded too (the tests' reference)."""

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        kv_b_proj: nn.Module,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.scale = scale
        self.kv_b_proj = kv_b_proj
        self.absorb = True

    def get_kv_cache_spec(self, cache_config: CacheConfig, dtype: str) -> MLAAttentionSpec:
        cache_dtype = kv_cache_dtype_name(getattr(cache_config, "cache_dtype", "auto"), dtype)
        if cache_dtype in ("float8_e4m3fn", "int8"):
            raise ValueError(
                f"--kv-cache-dtype {cache_config.cache_dtype} is not supported for multi-head latent "
                "attention (DeepSeek) yet; leave it auto."
            )
        return MLAAttentionSpec(
            cache_config.block_size, 1, self.kv_lora_rank + self.qk_rope_head_dim, cache_dtype
        )

    def forward(
        self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, H, qk_nope + rope], latent [T, R], k_pe [T, rope] -> [T, H * v_head_dim]."""
        cache, meta = self.cache_entry(batch)
        return self.attend(q, latent, k_pe, cache, meta)

    def attend(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``forward`` on an explicit page tensor and metadata."""
        flat, rows_per_block = flat_latent_view(cache)
        fresh = torch.cat((latent, k_pe), dim=-1)
        flat.index_copy_(
            0, latent_rows(meta.slot_mapping, meta.block_size, rows_per_block), fresh.to(flat.dtype)
        )
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        for i, group in enumerate(meta.decode_groups):
            rows = latent_rows(group.slots, meta.block_size, rows_per_block)
            kv = flat[rows.reshape(-1)].view(group.size, group.max_len, -1)
            mask = meta.decode_mask(i, None)  # [n, 1, 1, L]: real cache positions
            attend = self._absorbed if self.absorb else self._expanded
            out[group.tokens] = attend(q[group.tokens].unsqueeze(1), kv, mask)[:, 0].to(q.dtype)
        for i, chunk in enumerate(meta.prefills):
            if chunk.slots is None:
                kv = fresh[chunk.start : chunk.end]
            else:
                kv = flat[latent_rows(chunk.slots, meta.block_size, rows_per_block)]
            mask = meta.prefill_mask(i, None)
            o = self._expanded(q[chunk.start : chunk.end].unsqueeze(0), kv.unsqueeze(0), mask)
            out[chunk.start : chunk.end] = o[0].to(q.dtype)
        return out.view(q.shape[0], -1)

    def _split_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [H, qk_nope, R] and ``W_UV`` [H, v_head, R] (views of kv_b_proj's weight), float32."""
        w = self.kv_b_proj.weight.float().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled, masked (None: causal, aligned to the end of the keys), softmax over the keys."""
        scores = scores * self.scale
        if mask is None:
            lq, lk = scores.shape[-2], scores.shape[-1]
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)

    def _expanded(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [n, Lq, H, qk], kv [n, L, R + rope] -> [n, Lq, H, v]: the latents expanded into per-head K and V
        (transformers' ``expand_kv``), then attention; ``mask`` broadcastable to [n, H, Lq, L]."""
        latent, k_pe = kv.float().split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        n, length = kv.shape[:2]
        kv_heads = F.linear(latent, self.kv_b_proj.weight.float()).view(n, length, self.num_heads, -1)
        k_nope, v = kv_heads.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, :, None].expand(-1, -1, self.num_heads, -1)), dim=-1)
        probs = self._softmax(torch.einsum("nqhd,nkhd->nhqk", q.float(), k), mask)
        return torch.einsum("nhqk,nkhd->nqhd", probs, v)

    def _absorbed(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The same attention with W_UK absorbed into the query and W_UV applied after: scores and P V read
        the cached latent rows directly, nothing of the context is expanded."""
        latent, k_pe = kv.float().split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_nope, q_pe = q.float().split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self._split_weight()
        q_latent = torch.einsum("nqhd,hdr->nqhr", q_nope, w_uk)
        scores = torch.einsum("nqhr,nkr->nhqk", q_latent, latent) + torch.einsum("nqhd,nkd->nhqk", q_pe, k_pe)
        o_latent = torch.einsum("nhqk,nkr->nqhr", self._softmax(scores, mask), latent)
        return torch.einsum("nqhr,hvr->nqhv", o_latent, w_uv)
