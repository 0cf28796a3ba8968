"""The reasoning parsers tokenos ships, named as vLLM's ``--reasoning-parser`` names them."""

from __future__ import annotations

from tokenos.reasoning.base import ReasoningParser, ReasoningState


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the output begins inside the thinking, whether or not the
    template wrote ``<think>`` into the prompt; everything before ``</think>`` is reasoning."""

    name = "deepseek_r1"
    default_state = ReasoningState.REASONING


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens ``<think>`` itself unless the template did (thinking variants) or closed
    it (``enable_thinking: false``); an output that does not open it is all answer."""

    name = "qwen3"
    default_state = ReasoningState.OPEN
