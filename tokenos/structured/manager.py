"""The engine core's structured-output manager: grammars compiled off the busy loop, masks per step.

A request with a grammar does not enter the scheduler until its grammar is compiled: ``submit`` hands
the compile to a thread pool (llguidance drops the GIL while it builds), and each step ``take_ready``
returns the requests whose grammar is done (with a fresh matcher attached as ``request.grammar``) or
failed (with the error), in arrival order. Compiled grammars are cached by (kind, text): a repeated
schema costs one matcher copy. A compile running past ``compile_timeout_s`` fails its request.

Each step ``bitmasks`` fills one int32 row (bit t = token t allowed) for every scheduled request with a
grammar that samples this step (a decode, or the chunk that completes its prompt); the model runner sets
every other logit of that row to -inf before any sampling stage. The scheduler advances the matcher with
each accepted token and stops the request when the grammar is complete (`Request.grammar`).
With a reasoning parser, a request whose output starts in its thinking gets its matcher wrapped in a
`ReasoningGate`: no constraint until the thinking's end marker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tokenos.core.messages import StructuredSpec
from tokenos.core.request import Request
from tokenos.core.sched.output import SchedulerOutput
from tokenos.reasoning import ReasoningState
from tokenos.structured.backend import GrammarBackend, GrammarError, bitmask_words
from tokenos.structured.reasoning_gate import ReasoningGate

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
CACHE_SIZE = 64


class StructuredOutputManager:
    def __init__(
        self,
        make_backend: Any,
        vocab_size: int,
        compile_timeout_s: float = 30.0,
        reasoning_markers: Any = None,
    ) -> None:
        """``make_backend()`` builds the `GrammarBackend` (loading the tokenizer) on first use;
        ``reasoning_markers()``, with a reasoning parser, gives the token ids of its start and end
        markers: a request whose output starts in its thinking gets its grammar after it (`ReasoningGate`)."""
        self._make_backend = make_backend
        self._reasoning_markers = reasoning_markers
        self._markers: tuple[list[int], list[int]] | None = None
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="tokenos-grammar")
        self._cache: OrderedDict[StructuredSpec, Future] = OrderedDict()
        # request id -> (request, its compile, when submitted), in arrival order
        self._pending: OrderedDict[str, tuple[Request, Future, float]] = OrderedDict()

    # ------------------------------------------------------------ compiling

    def _backend_once(self) -> GrammarBackend:
        # Two compile threads may ask at once; the backend (a tokenizer's worth of tables) is built once.
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
        return self._backend

    def _compiled(self, spec: StructuredSpec) -> Future:
        future = self._cache.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(lambda: self._backend_once().compile(spec))
            self._cache[spec] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return future

    def submit(self, request: Request, spec: StructuredSpec) -> None:
        self._pending[request.request_id] = (request, self._compiled(spec), time.monotonic())

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Drop pending requests among ``request_ids``; returns those that were pending."""
        dropped = [self._pending.pop(rid, None) for rid in request_ids]
        return [entry[0] for entry in dropped if entry is not None]

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests now ready to schedule, (request, error) for those whose grammar failed)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for rid, (req, future, since) in list(self._pending.items()):
            if not future.done():
                if now - since > self.compile_timeout_s:
                    del self._pending[rid]
                    failed.append((req, f"grammar compilation exceeded {self.compile_timeout_s:.0f}s"))
                continue
            del self._pending[rid]
            error = future.exception()
            if error is None:
                req.grammar = self._matcher(req, future.result())
                ready.append(req)
            else:
                if not isinstance(error, GrammarError):
                    logger.error("grammar compilation of request %s failed: %r", rid, error)
                failed.append((req, f"structured output: {error}"))
        return ready, failed

    def _matcher(self, req: Request, compiled: Any) -> Any:
        matcher = self._backend_once().matcher(compiled)
        state = req.sampling_params.reasoning
        if not state or self._reasoning_markers is None:
            return matcher
        if self._markers is None:
            self._markers = self._reasoning_markers()
        return ReasoningGate(matcher, ReasoningState(state), *self._markers)

    # ------------------------------------------------------------ masks

    def bitmasks(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> dict[str, np.ndarray]:
        """req id -> its mask row, for the scheduled requests with a grammar that sample this step; a
        request with speculative drafts gets one row per verified position ([drafts + 1, words]): the
        grammar advanced through its drafts one by one, then rolled back (the scheduler advances it by
        the tokens the step accepts)."""
        rows: list[tuple[str, Request]] = []
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(rid)
            if (
                req is not None
                and req.grammar is not None
                and req.num_computed_tokens + num >= req.num_tokens
            ):
                rows.append((rid, req))
        if not rows:
            return {}
        words = bitmask_words(self.vocab_size)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        masks = np.zeros((len(rows), words), dtype=np.int32)
        out: dict[str, np.ndarray] = {}
        for i, (rid, req) in enumerate(rows):
            if drafts and drafts.get(rid):
                out[rid] = draft_masks(req.grammar, drafts[rid], words)
                continue
            req.grammar.fill_bitmask(masks, i)
            out[rid] = masks[i]
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def draft_masks(grammar: Any, drafts: list[int], words: int) -> np.ndarray:
    """Masks for a request's position and each of its drafts: row j is the grammar after drafts[:j].
    A draft the grammar refuses (the scheduler checked them, so only if its state moved) leaves the
    later rows equal to its own: its row forbids it, so verification rejects it and all after it."""
    masks = np.zeros((len(drafts) + 1, words), dtype=np.int32)
    grammar.fill_bitmask(masks, 0)
    accepted = 0
    for j, token in enumerate(drafts):
        if not grammar.accept(token):
            masks[j + 1 :] = masks[j]
            break
        accepted += 1
        grammar.fill_bitmask(masks, j + 1)
    if accepted:
        grammar.rollback(accepted)
    return masks
