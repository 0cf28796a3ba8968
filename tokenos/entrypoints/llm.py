"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`.

It drives an in-process `EngineCore` directly (same busy loop as the server's engine-core
process, no sockets), with the same front door (`InputProcessor`) and output processing as the server.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from tokenos.engine.args import EngineArgs
from tokenos.engine.core import EngineCore
from tokenos.engine.generation_config import engine_generation_defaults
from tokenos.engine.input_processor import InputProcessor, ProcessedRequest, Prompt, PromptType
from tokenos.engine.output_processor import OutputProcessor
from tokenos.engine.tokenizer import load_tokenizer
from tokenos.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from tokenos.entrypoints.progress import Progress
from tokenos.lora.request import LoRARequest
from tokenos.outputs import RequestOutput
from tokenos.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(
                f"Unknown LLM argument(s) {sorted(unknown)}; known: {sorted(EngineArgs.field_names())}."
            )
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine = EngineCore(self.engine_args)
        self.model_config = self.engine.model_config
        self.tokenizer = (
            None
            if self.engine_args.skip_tokenizer_init
            else load_tokenizer(self.engine_args.tokenizer or self.engine_args.model)
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_config,
            self.engine_args.chat_template,
            max_logprobs=self.engine_args.max_logprobs,
            reasoning_parser=self.engine_args.reasoning_parser,
            structured_backend=self.engine_args.structured_outputs_backend,
            logits_processors=self.engine_args.logits_processors,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.generation_defaults = engine_generation_defaults(self)
        self._counter = itertools.count()
        self._num_requests = 0
        self._num_generation_tokens = 0
        self._num_prompt_tokens = 0

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------ generate

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: the LoRA adapter every prompt runs under, or one (or None) per prompt; an
        adapter not loaded yet is loaded first (`add_lora`). Needs ``LLM(..., enable_lora=True)``."""
        if isinstance(prompts, str | dict | Prompt) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        adapters = self._lora_names(lora_request, len(prompts))
        # Every request through the front door before any reaches the engine: one bad prompt fails
        # the call and leaves nothing half-submitted.
        requests = [
            self.input_processor.process(
                str(next(self._counter)),
                prompt,
                params,
                priority=priority[i] if priority else 0,
                output_kind=RequestOutputKind.FINAL_ONLY,
                lora_name=adapters[i],
            )
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True))
        ]
        added: list[str] = []
        try:
            for request in requests:
                self._add_request(request)
                added.append(request.request_id)
        except ValueError:  # the engine core refused one (an adapter it cannot load): none of them run
            for request_id in added:
                self.engine.abort_requests(self.output_processor.abort_request(request_id))
            raise
        return self._run([r.request_id for r in requests], use_tqdm)

    # ------------------------------------------------------------ LoRA

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (checked against the model now); True if it was not loaded yet. ValueError
        when it cannot serve (LoRA off, a bad folder, another base model, a rank above max_lora_rank), or
        when its name is already loaded from another folder."""
        loaded = {info["name"]: info for info in self.engine.list_loras()}
        known = loaded.get(lora_request.lora_name)
        if known is None:
            self.engine.add_lora(lora_request.lora_name, lora_request.lora_path)
            return True
        if known["path"] != os.path.abspath(lora_request.lora_path):
            raise ValueError(
                f"a LoRA adapter named {lora_request.lora_name!r} is already loaded from {known['path']}: "
                "remove_lora it first, or pick another name."
            )
        return False

    def remove_lora(self, lora_name: str) -> bool:
        return self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[dict]:
        return self.engine.list_loras()

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[str | None]:
        if lora_request is None:
            return [None] * n
        requests = [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(requests) != n:
            raise ValueError(
                f"Got {len(requests)} lora_request for {n} prompts: give one, or one per prompt."
            )
        for r in {r for r in requests if r is not None}:
            self.add_lora(r)
        return [r.lora_name if r is not None else None for r in requests]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (one or a list); ``tools`` and ``chat_template_kwargs``
        reach the template (as in vLLM, the offline reply is text: no tool-call parsing).
        ``continue_final_message``: the last (assistant) message is continued rather than answered (then
        ``add_generation_prompt`` must be False)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message: set add_generation_prompt=False."
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompts = [
            self.input_processor.render_chat(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the ``beam_width`` best sequences of each prompt (best first), each
        with its tokens (prompt included), the generated tokens' logprobs, the cumulative logprob and the
        text (`tokenos.entrypoints.beam_search`)."""
        width = params.beam_width
        if 2 * width > self.engine_args.max_logprobs:
            raise ValueError(
                f"beam_width {width} needs {2 * width} logprobs per step; the engine allows "
                f"{self.engine_args.max_logprobs} (max_logprobs)."
            )
        token_lists = [self.input_processor.tokenize_prompt(p).token_ids for p in prompts]
        for tokens in token_lists:
            self.input_processor.check_prompt(tokens)
            self.input_processor.check_context(len(tokens), params.max_tokens)

        def step(beams: list[list[int]], k: int) -> list[dict[int, float]]:
            one_token = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)
            outs = self.generate([{"prompt_token_ids": b} for b in beams], one_token, use_tqdm=False)
            return [{t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()} for out in outs]

        found = beam_search(token_lists, params, step, self.input_processor.eos_token_id)
        for sequences in found:
            for beam in sequences:
                if self.tokenizer is not None:
                    beam.text = self.tokenizer.decode(beam.tokens)
        return [BeamSearchOutput(sequences) for sequences in found]

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params gets: the generation config's recommended settings
        (``generation_config="auto"``, vLLM's default), else SamplingParams' own defaults."""
        return SamplingParams(**self.generation_defaults)

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(
                f"Got {len(params)} sampling_params for {n} prompts: give one, or one per prompt."
            )
        return params

    def _add_request(self, request: ProcessedRequest) -> None:
        added: list[str] = []
        try:
            for sample in request.engine_requests:
                self.engine.add_request(sample)
                added.append(sample.request_id)
        except ValueError:
            self.engine.abort_requests(added)
            raise
        self.output_processor.add_request(request)
        self._num_requests += 1
        self._num_prompt_tokens += len(request.prompt.token_ids) * request.params.n

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        progress = Progress(len(request_ids), use_tqdm)
        while self.output_processor.has_unfinished_requests():
            step = self.engine.step()
            ready, to_abort = self.output_processor.process_outputs(step.outputs)
            if to_abort:
                self.engine.abort_requests(to_abort)
            for out in ready:
                if out.finished:
                    results[out.request_id] = out
                    generated = sum(len(c.token_ids) for c in out.outputs)
                    self._num_generation_tokens += generated
                    progress.update(len(out.prompt_token_ids or ()), generated)
        progress.close()
        return [results[r] for r in request_ids]

    # ------------------------------------------------------------ introspection

    def get_metrics(self) -> dict:
        stats = self.engine.get_stats()
        return {
            "num_requests": self._num_requests,
            "prompt_tokens": self._num_prompt_tokens,
            "generation_tokens": self._num_generation_tokens,
            "prefix_cache_queries": stats.get("prefix_cache_queries", 0),
            "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
            "num_preemptions": stats.get("num_preemptions", 0),
            "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
            "num_running": stats.get("num_running", 0),
            "num_waiting": stats.get("num_waiting", 0),
            **({"spec_decoding": spec_summary(stats["spec_decoding"])} if "spec_decoding" in stats else {}),
        }

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()


def spec_summary(spec: dict) -> dict:
    """The core's speculative-decoding counters plus what vLLM derives from them: the acceptance rate
    (accepted / draft tokens), the mean acceptance length (1 + accepted / drafts: tokens per verifying
    step) and the acceptance rate at each draft position."""
    drafts, proposed, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
    return {
        **spec,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "acceptance_rate_per_pos": [a / drafts if drafts else 0.0 for a in spec["accepted_per_pos"]],
    }
