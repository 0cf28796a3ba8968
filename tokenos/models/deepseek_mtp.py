"""DeepSeek V3's multi-token-prediction (MTP) layer, as the released checkpoints ship it: decoder layer
``num_hidden_layers`` (``model.layers.{N}.*``, one per ``num_nextn_predict_layers``).

At position i it reads the target's hidden state h_i (after the target's final norm) and token t_{i+1}:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))       # embedding first; 0 at position 0
    x = x + block(x)   # a DeepSeek decoder layer (MLA, MoE): its output with the residual added
    logits = shared_head.head(shared_head.norm(x))

as vLLM's DeepSeekMTP does (the embedding of position 0 zeroed: the released code's training masks it).
The layer's ``embed_tokens`` is a copy of the target's (DeepSeek-V3 report: the MTP modules share the
embedding): the target's is used and the copy is not loaded. Drafts after the first feed ``x`` back as
the hidden state. The block's MLA attention is a cache layer of its own, bound here (entry 0).
"""

from __future__ import annotations

import torch

from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear
from tokenos.layers.metadata import ForwardBatch, bind_cache_layers
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.models.base import PagedModel
from tokenos.models.config import ModelConfig
from tokenos.models.deepseek import GATE_UP, DeepseekDecoderLayer
from tokenos.models.qwen_moe import expert_mapping

# The MTP layer's own parts; every other tensor under its prefix is the decoder block's.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class SharedHead(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = LMHead(config.vocab_size, config.hidden_size)


class DeepseekMTP(PagedModel):
    """Registered under the checkpoint's names with ``model.layers.{N}.`` taken off (the block under
    ``mtp_block.``, `checkpoint_name`), sharing the target's embeddings and rotary table."""

    def __init__(self, config: ModelConfig, embed: VocabEmbedding, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.packed_modules_mapping = {**expert_mapping(int(config.hf_config["n_routed_experts"])), **GATE_UP}
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.mtp_block = DeepseekDecoderLayer(config, rotary, config.num_hidden_layers, v3=True)
        self.shared_head = SharedHead(config)
        self._shared = (embed, rotary)  # the target's, outside the module tree
        self._cache_layers = bind_cache_layers(self)

    @classmethod
    def for_target(cls, config: ModelConfig, target: torch.nn.Module) -> DeepseekMTP:
        return cls(config, target.stack.embed, target.stack.rotary)

    @staticmethod
    def num_layers(config: ModelConfig, names: list[str]) -> int:
        """MTP layers the config declares (each under its own ``model.layers.{N + i}.``), 0 without
        tensors under the first one's prefix (``names``)."""
        return int(config.hf_config.get("num_nextn_predict_layers") or 0) if names else 0

    @staticmethod
    def weight_prefix(config: ModelConfig) -> str:
        return f"model.layers.{config.num_hidden_layers}."

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter name for a checkpoint tensor under `weight_prefix` (None: not loaded)."""
        if name.startswith("embed_tokens."):
            return None  # the target's embeddings serve
        return name if name.startswith(_OWN) else "mtp_block." + name

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        embed, rotary = self._shared
        e = embed(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        x, residual = self.mtp_block(rotary.cos_sin(positions, x.dtype), x, None, batch)
        return x + residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))
