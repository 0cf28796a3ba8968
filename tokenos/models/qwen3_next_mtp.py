"""Qwen3-Next's multi-token-prediction (MTP) layer, as the released checkpoints ship it under ``mtp.*``.

At position i it reads the target's hidden state h_i (after the target's final norm, what the target's
forward returns) and the token t_{i+1}, and predicts t_{i+2}:

    x = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))    # embedding first
    x = layers.0(x)      # a Qwen3-Next full-attention decoder layer (gated attention, MoE), rope at i
    out = norm(x);  logits = lm_head(out)

``embed_tokens`` and ``lm_head`` are the target's own (the checkpoint has no copy under ``mtp.``). Drafts
after the first feed ``out`` back as the hidden state, with the draft just made as the token, one
position further (vLLM's Qwen3NextMTP does the same). Every norm is the offset RMSNorm of the target.
The layer's attention is a cache layer of its own, bound here (entry 0); the worker gives it pages in the
target's pool (`tokenos.worker.mtp`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.gated_delta import GatedDeltaDims
from tokenos.layers.linear import Linear
from tokenos.layers.metadata import ForwardBatch, bind_cache_layers
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, PagedModel
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import hf_attrs
from tokenos.models.qwen3_next import Qwen3NextDecoderLayer, offset_norm

# The checkpoint's names of the MTP weights start with this.
MTP_PREFIX = "mtp."


class Qwen3NextMTP(PagedModel):
    """The ``mtp.*`` modules (registered under the checkpoint's names with ``mtp.`` taken off), sharing
    the target's embeddings, LM head and rotary table."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(
        self, config: ModelConfig, embed: VocabEmbedding, lm_head: LMHead, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = offset_norm(hidden, config)
        self.pre_fc_norm_hidden = offset_norm(hidden, config)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        dims = GatedDeltaDims.from_config(hf_attrs(config))  # unused by a full-attention layer
        # Layer index 0 decides MoE or dense MLP, as vLLM reads it from the module name mtp.layers.0.
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, 0, "full_attention", rotary, dims)])
        self.norm = offset_norm(hidden, config)
        # Held outside the module tree: they are the target's parameters, loaded and packed with it.
        self._shared = (embed, lm_head, rotary)
        self._cache_layers = bind_cache_layers(self)

    @classmethod
    def for_target(cls, config: ModelConfig, target: nn.Module) -> Qwen3NextMTP:
        return cls(config, target.stack.embed, target.lm_head, target.stack.rotary)

    @staticmethod
    def weight_prefix(config: ModelConfig) -> str:
        return MTP_PREFIX

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter name for a checkpoint tensor under `weight_prefix`: the same."""
        return name

    @staticmethod
    def num_layers(config: ModelConfig, names: list[str]) -> int:
        """MTP layers in the checkpoint (``names``: its tensors under `weight_prefix`)."""
        return len({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The MTP's output hidden states ``[T, hidden]`` for tokens ``input_ids`` (t_{i+1}) at
        ``positions`` (i) over the target's ``hidden`` (h_i); writes its K/V at those positions."""
        embed, _, rotary = self._shared
        e = self.pre_fc_norm_embedding(embed(input_ids))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, h], dim=-1))
        rope = rotary.cos_sin(positions, x.dtype)
        x, residual = self.layers[0](rope, x, None, batch)
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](hidden)
