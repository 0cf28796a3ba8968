"""The front door: every request enters the engine here, whether it came from `LLM`, `AsyncLLM` or HTTP.

`InputProcessor` owns the tokenizer side of a request and nothing else does:
- text -> token ids (`encode`, `tokenize_prompt`) and ids -> text (`decode`, ids checked first);
- the ONE chat-template path (`render_chat`): render the conversation to text with the request's
  template, else the engine's ``--chat-template``, else the tokenizer's own, then encode it without
  special tokens (the template writes its own BOS); `LLM.chat`, ``/v1/chat/completions`` and
  ``/tokenize`` all use it;
- validation against the model, with one set of messages (`check_prompt`, `check_params`,
  `check_context`), raising `InvalidRequestError` whose ``param`` names the field at fault;
- conversion (`process`): a user's `SamplingParams` becomes the typed `EngineCoreRequest`s of its n
  samples. Samples 1..n-1 carry ``fork_of`` = sample 0, so the scheduler computes the prompt once and
  forks them from sample 0 (attention pages shared by refcount, recurrent state copied); sample i gets
  seed + i. On the way the prompt keeps only its last ``truncate_prompt_tokens`` tokens (`truncate`,
  before any check of its length) and the ``bad_words`` become token-id sequences
  (`bad_words_token_ids`, vLLM's tokenization); the engine's custom logits processors may refuse the
  parameters (their ``validate_params``).

The engine core checks prompts again with the same functions (`tokenos.core.validation`), so both
processes speak with one voice.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any

from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams, StructuredSpec
from tokenos.core.validation import (
    INT64_MAX,
    INT64_MIN,
    InvalidRequestError,
    check_bad_words_token_ids,
    check_prompt_tokens,
    check_sampling_for_model,
    check_token_ids,
    resolve_truncation,
)
from tokenos.reasoning import get_reasoning_parser
from tokenos.sampling_params import RequestOutputKind, SamplingParams
from tokenos.structured.backend import GrammarError, backend_name, check_grammar


@dataclass(frozen=True)
class Prompt:
    """A prompt as the engine runs it: its token ids, and its text when there is one."""

    token_ids: list[int]
    text: str | None = None


# What users may pass as a prompt: text, token ids, {"prompt": ...} / {"prompt_token_ids": ...}, a Prompt.
PromptType = str | list[int] | dict[str, Any] | Prompt


@dataclass
class ProcessedRequest:
    """A request through the front door: the frontend's own copy of its parameters (stop strings,
    output kind, detokenization) and the engine-core requests of its samples."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    engine_requests: list[EngineCoreRequest]

    @property
    def sample_ids(self) -> list[str]:
        return [r.request_id for r in self.engine_requests]


def sample_request_id(index: int, parent_id: str) -> str:
    """The engine-core id of sample ``index`` of an n > 1 request."""
    return f"{index}_{parent_id}"


# Templates tokenos ships, by name (``--chat-template chatml_tools``): for models whose own lacks tools.
SHIPPED_TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "chat_templates")


def shipped_template_path(name: str) -> str | None:
    path = os.path.join(SHIPPED_TEMPLATES, f"{name}.jinja")
    return path if name.isidentifier() and os.path.isfile(path) else None


def resolve_chat_template(template: str | None) -> str | None:
    """``--chat-template`` is a file path, the name of a shipped template, or the template itself."""
    path = template and (shipped_template_path(template) or template)
    if path and os.path.isfile(path):
        with open(path) as f:
            return f.read()
    return template


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s seed: ``seed + index``, wrapped to stay an int64."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN if seed + index > INT64_MAX else seed + index


def engine_sampling_params(
    params: SamplingParams,
    seed: int | None,
    reasoning: int = 0,
    bad_words_token_ids: list[list[int]] | None = None,
) -> EngineSamplingParams:
    """What the engine core needs of ``params`` (token-level rules only), with sample's ``seed``, (with a
    reasoning parser and a grammar) the `ReasoningState` the output starts in, and the bad words
    tokenized (`InputProcessor.bad_words_token_ids`)."""
    return EngineSamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        structured=structured_spec(params),
        reasoning=reasoning,
        allowed_token_ids=list(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
        bad_words_token_ids=bad_words_token_ids or None,
        # Its own copy: in-process (LLM) the processors would otherwise share the caller's dict.
        extra_args=copy.deepcopy(params.extra_args),
    )


def structured_spec(params: SamplingParams) -> StructuredSpec | None:
    if params.structured_outputs is None:
        return None
    return StructuredSpec(*params.structured_outputs.spec())


def _load_logits_processors(specs: list[Any] | None) -> list[Any]:
    """The processor classes (imported only when there are any: they are torch code)."""
    if not specs:
        return []
    from tokenos.sample.logits_processor import load_logits_processors

    return load_logits_processors(specs)


def _validate_for_processors(classes: list[Any], params: EngineSamplingParams) -> None:
    from tokenos.sample.logits_processor import validate_logits_processor_params

    validate_logits_processor_params(classes, params)


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        model_config: Any,
        chat_template: str | None = None,
        max_logprobs: int = 20,
        reasoning_parser: str | None = None,
        structured_backend: str | None = None,
        logits_processors: list[Any] | None = None,
    ) -> None:
        """``tokenizer`` may be None (``skip_tokenizer_init``: token-id prompts only); ``model_config``
        gives ``max_model_len``, ``vocab_size`` and ``eos_token_ids``; ``max_logprobs`` caps the top-n
        logprobs a request may ask for (vLLM's default, 20); ``reasoning_parser`` names the thinking
        markers of a reasoning model (`tokenos.reasoning`); ``structured_backend`` the grammar backend the
        engine compiles with (grammars are checked against it); ``logits_processors`` the engine's custom
        processors (``EngineArgs.logits_processors``), whose ``validate_params`` every request passes."""
        self.tokenizer = tokenizer
        self.logits_processors = _load_logits_processors(logits_processors)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.structured_backend = backend_name(structured_backend)
        self.max_logprobs = max_logprobs
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.vocab_size
        config_eos = list(getattr(model_config, "eos_token_ids", None) or ())
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None and config_eos:
            self.eos_token_id = config_eos[0]
        self.extra_eos_token_ids = sorted(set(config_eos) - {self.eos_token_id})
        self.chat_template = resolve_chat_template(chat_template)

    # ------------------------------------------------------------ text

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "This engine was started with skip_tokenizer_init: give prompt_token_ids, not text.", "prompt"
            )
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        tokenizer = self._require_tokenizer()
        self._check_text_length(text, param)
        try:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except UnicodeEncodeError as e:  # a lone surrogate, from JSON escapes
            raise InvalidRequestError(f"The text is not valid Unicode: {e.reason}.", param) from e

    def _check_text_length(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context whatever its tokens: each token
        covers at most ``max_token_chars`` characters (the margin of 4 covers normalizers that shrink
        text, such as combining marks folded by NFC)."""
        per_token = getattr(self.tokenizer, "max_token_chars", None)
        if per_token is None:
            return
        limit = 4 * per_token * self.max_model_len
        if len(text) > limit:
            raise InvalidRequestError(
                f"The text is {len(text)} characters long: more than {self.max_model_len} tokens "
                f"(max_model_len) of this tokenizer can ever hold. Please shorten it.",
                param,
            )

    def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        """The text of ``token_ids`` (special tokens kept); ids outside the vocabulary are refused first."""
        check_token_ids(token_ids, self.vocab_size, "Token", param)
        return self._require_tokenizer().decode(token_ids, skip_special_tokens=False)

    def tokenize_prompt(self, prompt: PromptType) -> Prompt:
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            return Prompt(self.encode(prompt), prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return Prompt(list(prompt["prompt_token_ids"]), prompt.get("prompt"))
            if "prompt" in prompt:
                return Prompt(self.encode(prompt["prompt"]), prompt["prompt"])
            raise InvalidRequestError("A prompt dict needs 'prompt' (text) or 'prompt_token_ids'.", "prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return Prompt(list(prompt))
        raise InvalidRequestError(
            f"Unsupported prompt type {type(prompt).__name__}: give text or token ids.", "prompt"
        )

    def active_chat_template(self, chat_template: str | None = None) -> str | None:
        """The template a conversation is rendered with: the request's, else the engine's
        ``--chat-template``, else the tokenizer's own (None: there is none)."""
        own = getattr(self.tokenizer, "chat_template", None)
        return resolve_chat_template(chat_template) or self.chat_template or own

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> Prompt:
        """The conversation as the prompt the model runs: the rendered text and its token ids."""
        if not messages:
            raise InvalidRequestError("A conversation needs at least one message.", "messages")
        tokenizer = self._require_tokenizer()
        template = resolve_chat_template(chat_template) or self.chat_template  # None: the tokenizer's own
        try:
            text = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                **template_kwargs,
            )
        except Exception as e:  # jinja errors, a missing template: the request (or its template) is at fault
            raise InvalidRequestError(f"Cannot apply the chat template: {e}", "messages") from e
        # The template already holds the special tokens (BOS) it needs.
        return Prompt(self.encode(text, add_special_tokens=False, param="messages"), text)

    # ------------------------------------------------------------ validation

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        check_prompt_tokens(token_ids, self.max_model_len, self.vocab_size, param)

    def check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: token ids against this model's vocabulary, the
        number of logprobs."""
        check_sampling_for_model(params, self.vocab_size, self.max_logprobs)
        spec = structured_spec(params)
        if spec is not None:
            try:
                check_grammar(spec, self.structured_backend)
            except GrammarError as e:
                raise InvalidRequestError(str(e), "structured_outputs") from None

    def truncate(self, prompt: Prompt, params: SamplingParams) -> Prompt:
        """The prompt as it runs: its last ``truncate_prompt_tokens`` tokens (-1: as many as the model can
        run); its text is kept, as vLLM keeps the prompt's text. Call before checking its length."""
        keep = resolve_truncation(params.truncate_prompt_tokens, self.max_model_len)
        if keep is None or len(prompt.token_ids) <= keep:
            return prompt
        return Prompt(prompt.token_ids[len(prompt.token_ids) - keep :], prompt.text)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word (leading spaces dropped) alone, and after a space
        (the same word in the middle of a text) when that gives other tokens of the same count."""
        if not words:
            return []
        if self.tokenizer is None:
            raise InvalidRequestError(
                "bad_words needs the tokenizer, and this engine was started with skip_tokenizer_init: "
                "ban token ids with logit_bias instead.",
                "bad_words",
            )
        sequences: list[list[int]] = []
        for word in words:
            alone = self.encode(word.lstrip(), add_special_tokens=False, param="bad_words")
            if not alone:
                raise InvalidRequestError(f"The bad word {word!r} has no tokens.", "bad_words")
            sequences.append(alone)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False, param="bad_words")
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        check_bad_words_token_ids(sequences)
        for ids in sequences:
            check_token_ids(ids, self.vocab_size, "bad_words token", "bad_words")
        return sequences

    def check_context(self, prompt_len: int, max_tokens: int | None, param: str = "max_tokens") -> None:
        """The OpenAI API's rule: the prompt plus the requested completion must fit the context."""
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or the completion.",
                param,
            )

    # ------------------------------------------------------------ conversion

    def reasoning_state(self, prompt: Prompt, params: SamplingParams) -> int:
        """Where a constrained output starts (`ReasoningState`), read off the prompt; 0 without a
        reasoning parser or a grammar (the core then masks from the first token)."""
        if self.reasoning_parser is None or params.structured_outputs is None:
            return 0
        return int(self.reasoning_parser.initial_state(prompt.text))

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | None = None,
        lora_name: str | None = None,
    ) -> ProcessedRequest:
        """Tokenize, validate and convert one request; ValueError (InvalidRequestError) when it cannot run."""
        tokenized = self.truncate(self.tokenize_prompt(prompt), params)
        self.check_prompt(tokenized.token_ids)
        self.check_params(params)
        bad_words = self.bad_words_token_ids(params.bad_words or [])
        params = copy.copy(params)
        if output_kind is not None:
            params.output_kind = output_kind
        if self.tokenizer is None:
            params.detokenize = False
        arrival = time.time() if arrival_time is None else arrival_time
        reasoning = self.reasoning_state(tokenized, params)
        samples: list[EngineCoreRequest] = []
        for i in range(params.n):
            seed = sample_seed(params.seed, i)
            engine_params = engine_sampling_params(params, seed, reasoning, bad_words)
            if i == 0 and self.logits_processors:
                _validate_for_processors(self.logits_processors, engine_params)
            samples.append(
                EngineCoreRequest(
                    request_id=request_id if params.n == 1 else sample_request_id(i, request_id),
                    prompt_token_ids=tokenized.token_ids,
                    sampling_params=engine_params,
                    eos_token_id=self.eos_token_id,
                    extra_eos_token_ids=self.extra_eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                    fork_of=samples[0].request_id if samples else None,
                    lora_name=lora_name,
                )
            )
        return ProcessedRequest(request_id, tokenized, params, samples)
