"""The sampling parameters of the persistent batch, one row per running request.

The worker keeps requests in rows 0..num_reqs-1 across steps and only tells this store what
changed: a request arrived (`add_request`), left (`remove_request`), moved to close a gap
(`move_row`), or got a token (`append_output`). Scalar parameters live in preallocated CPU tensors
of `max_num_reqs` entries, so building a step's `SamplingMetadata` is a slice, and it is rebuilt
only when the batch changed; otherwise the cached one is reused with just the rows that depend on the
output so far refreshed (min_tokens, bad words). Nothing here is vocab-sized: penalties are computed from
the token id lists at sampling, and the allowed-token mask is built with the metadata, for the rows that
have one.

Speculative decoding verifies k draft tokens of a row in k + 1 rows of logits: `make_spec_metadata` gives
the metadata of those rows, each as its row after the drafts before it, from the same cached metadata.

Bad words are matched against the output tokens only (vLLM's rule), so they need no state of their
own: a request resumed after a preemption comes back with its outputs and bans exactly what it banned.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace

import torch

from tokenos.core.messages import EngineSamplingParams
from tokenos.sample import ops
from tokenos.sample.logits_processor.state import LogitsProcessors
from tokenos.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


class SamplingState:
    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        logitsprocs: LogitsProcessors | None = None,
    ) -> None:
        """``logitsprocs``: the engine's custom logits processors (the batch keeps them up to date), handed
        to the sampler with every metadata."""
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        n = max_num_reqs
        self.temperature = torch.ones(n, dtype=torch.float32)
        self.top_k = torch.zeros(n, dtype=torch.int64)
        self.top_p = torch.ones(n, dtype=torch.float32)
        self.min_p = torch.zeros(n, dtype=torch.float32)
        self.presence = torch.zeros(n, dtype=torch.float32)
        self.frequency = torch.zeros(n, dtype=torch.float32)
        self.repetition = torch.ones(n, dtype=torch.float32)
        # Per-row Python objects: lists of length max_num_reqs, None where the row is empty.
        self.occupied = [False] * n
        self.is_greedy = [True] * n
        self.min_tokens = [0] * n
        self.stop_ids: list[list[int]] = [[] for _ in range(n)]  # forbidden below min_tokens
        self.generators: list[torch.Generator | None] = [None] * n
        self.logit_bias: list[dict[int, float] | None] = [None] * n
        self.num_logprobs: list[int | None] = [None] * n
        self.prompt_token_ids: list[list[int]] = [[] for _ in range(n)]
        self.output_token_ids: list[list[int]] = [[] for _ in range(n)]
        self.allowed_token_ids: list[list[int] | None] = [None] * n  # sorted, unique
        self.bad_words: list[list[list[int]] | None] = [None] * n
        self.num_bad_words_rows = 0  # rows with bad words: none, and the per-step matching is skipped
        self.logitsprocs = logitsprocs if logitsprocs else None
        self._cached: SamplingMetadata | None = None

    # ------------------------------------------------------------ changes

    def add_request(
        self,
        row: int,
        params: EngineSamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_id: int | None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """Put a request in `row` (empty or about to be overwritten). `output_token_ids` is what it
        generated before a preemption (its seeded generator skips the draws those took); the list is
        copied, later tokens come via `append_output`.
        `stop_token_ids` (and the EOS unless ignore_eos) cannot be sampled below min_tokens."""
        self._check_row(row)
        greedy = params.temperature < _GREEDY_EPS
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.occupied[row] = True
        self.is_greedy[row] = greedy
        self.min_tokens[row] = params.min_tokens
        stop = set(params.stop_token_ids) | set(stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop.add(eos_token_id)
        self.stop_ids[row] = sorted(t for t in stop if 0 <= t < self.vocab_size)
        self.generators[row] = (
            None if params.seed is None else self._make_generator(params.seed, len(output_token_ids))
        )
        # Ids beyond the model's vocabulary can never be sampled, so their bias is moot.
        bias = {t: b for t, b in (params.logit_bias or {}).items() if 0 <= t < self.vocab_size}
        self.logit_bias[row] = bias or None
        self.num_logprobs[row] = params.logprobs
        self.prompt_token_ids[row] = list(prompt_token_ids)
        self.output_token_ids[row] = list(output_token_ids)
        allowed = params.allowed_token_ids
        self.allowed_token_ids[row] = (
            None if allowed is None else sorted({t for t in allowed if 0 <= t < self.vocab_size})
        )
        self._set_bad_words(row, getattr(params, "bad_words_token_ids", None))
        self._cached = None

    def _set_bad_words(self, row: int, sequences: list[list[int]] | None) -> None:
        self.num_bad_words_rows -= self.bad_words[row] is not None
        self.bad_words[row] = [list(ids) for ids in sequences] if sequences else None
        self.num_bad_words_rows += self.bad_words[row] is not None

    def remove_request(self, row: int) -> None:
        self._check_row(row)
        self._clear(row)
        self._cached = None

    def move_row(self, src: int, dst: int) -> None:
        """Move the request in `src` to `dst` (whatever was in `dst` is dropped); `src` is left empty."""
        self._check_row(src)
        self._check_row(dst)
        if src == dst:
            return
        for t in self._tensors():
            t[dst] = t[src]
        self._set_bad_words(dst, None)  # the request in dst is dropped (its count with it)
        for lst in self._lists():
            lst[dst] = lst[src]
        self.bad_words[src] = None  # moved, not dropped: the count stays
        self._clear(src)
        self._cached = None

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange two rows (for reordering the batch, e.g. by priority)."""
        self._check_row(a)
        self._check_row(b)
        for t in self._tensors():
            t[a], t[b] = t[b].clone(), t[a].clone()
        for lst in self._lists():
            lst[a], lst[b] = lst[b], lst[a]
        self._cached = None

    def append_output(self, row: int, token_id: int) -> None:
        # The metadata holds this very list, so a cached metadata stays current.
        self.output_token_ids[row].append(token_id)

    # ------------------------------------------------------------ metadata

    def make_metadata(self, num_reqs: int, discard_rows: Sequence[int] = ()) -> SamplingMetadata:
        """The metadata for rows 0..num_reqs-1.

        `discard_rows`: rows whose sample this step will be thrown away (a partial prefill chunk).
        Their seeded generators are left untouched, so a seeded request's draws depend only on the
        tokens it really generates.
        """
        md = self._base_metadata(num_reqs)
        rows = range(num_reqs)
        md.min_tokens = self._min_token_bans(rows, self.output_token_ids)
        md.bad_words = self._bad_word_bans(rows, self.output_token_ids) if self.num_bad_words_rows else {}
        if discard_rows:
            md = _copy_without_generators(md, discard_rows)
        return md

    def make_spec_metadata(
        self, num_reqs: int, draft_token_ids: Sequence[Sequence[int]], discard_rows: Sequence[int] = ()
    ) -> SamplingMetadata:
        """The metadata for verifying draft tokens (`RejectionSampler`): row i of the batch with drafts
        d_1..d_k becomes the k + 1 consecutive "virtual rows" (i, 0..k), requests in batch order.

        Virtual row (i, j) samples exactly as row i would in plain decoding once d_1..d_j had been
        appended to its outputs: same parameters, penalties counting the drafts, min_tokens bans while
        len(outputs) + j < min_tokens, bad words matched on outputs + d_1..d_j, and the very generator of
        a seeded row. Custom logits processors are left out (None): they follow the batch's rows, and
        the engine refuses speculative decoding with them. `discard_rows` (batch rows) as in
        `make_metadata`. Neither the metadata cached for `make_metadata` nor the outputs are changed.
        """
        if len(draft_token_ids) != num_reqs:
            raise ValueError(f"{len(draft_token_ids)} draft lists for {num_reqs} rows.")
        base = self._base_metadata(num_reqs)
        repeats = [len(d) + 1 for d in draft_token_ids]
        src = [r for r, count in enumerate(repeats) for _ in range(count)]
        outputs = []  # copies: each virtual row keeps what it saw when the accepted tokens are appended
        for r, drafts in enumerate(draft_token_ids):
            out = self.output_token_ids[r]
            seen = out + list(drafts)
            outputs.extend(seen[: len(out) + j] for j in range(len(drafts) + 1))
        md = self._repeat_rows(base, repeats, src)
        md.output_token_ids = outputs
        md.min_tokens = self._min_token_bans(src, outputs)
        md.bad_words = self._bad_word_bans(src, outputs) if self.num_bad_words_rows else {}
        skip = set(discard_rows)
        md.generators = {
            v: g for v, r in enumerate(src) if (g := base.generators.get(r)) is not None and r not in skip
        }
        return md

    def _base_metadata(self, num_reqs: int) -> SamplingMetadata:
        """The cached metadata of rows 0..num_reqs-1 (rebuilt when the batch changed); its output-dependent
        fields are stale until the caller sets them."""
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs={num_reqs} is outside [0, {self.max_num_reqs}].")
        md = self._cached
        if md is None or md.num_reqs != num_reqs:
            md = self._cached = self._build(num_reqs)
        return md

    def _repeat_rows(self, md: SamplingMetadata, repeats: list[int], src: list[int]) -> SamplingMetadata:
        """``md`` with row r repeated ``repeats[r]`` times (``src``: the row of each copy), each copy with
        its row's parameters. The output-dependent fields and the generators are the caller's to set."""
        dev = self.device
        index = torch.tensor(src, dtype=torch.int64).to(dev)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        # The sparse fields' rows are known here from the lists `_build` made them of (in the same order),
        # so they are spread without reading a device tensor back.
        first = [0]
        for count in repeats[:-1]:
            first.append(first[-1] + count)
        bias = None
        if md.logit_bias is not None:
            _, cols, vals = md.logit_bias
            owners = [r for r in range(md.num_reqs) for _ in self.logit_bias[r] or {}]
            entries, new_rows = _spread(owners, first, repeats, dev)
            bias = (new_rows, cols[entries], vals[entries])
        allowed = None
        if md.allowed_token_ids is not None:
            owners = [r for r in range(md.num_reqs) if self.allowed_token_ids[r] is not None]
            entries, new_rows = _spread(owners, first, repeats, dev)
            allowed = (new_rows, md.allowed_token_ids[1][entries])
        return replace(
            md,
            num_reqs=len(src),
            temperature=rows(md.temperature),
            greedy_mask=rows(md.greedy_mask),
            top_k=rows(md.top_k),
            top_p=rows(md.top_p),
            min_p=rows(md.min_p),
            generators={},
            presence_penalties=rows(md.presence_penalties),
            frequency_penalties=rows(md.frequency_penalties),
            repetition_penalties=rows(md.repetition_penalties),
            prompt_token_ids=rows(md.prompt_token_ids),
            output_token_ids=[],
            logit_bias=bias,
            min_tokens={},
            num_logprobs=[md.num_logprobs[r] for r in src],
            allowed_token_ids=allowed,
            bad_words={},
            logitsprocs=None,
        )

    def _build(self, n: int) -> SamplingMetadata:
        dev = self.device
        greedy = torch.tensor(self.is_greedy[:n], dtype=torch.bool)
        random = ~greedy
        any_random = bool(random.any())
        top_k = self.top_k[:n]
        top_p = self.top_p[:n]
        min_p = self.min_p[:n]
        use_top_k = any_random and bool(((top_k > 0) & random).any())
        use_top_p = any_random and bool(((top_p < 1.0) & random).any())
        use_min_p = any_random and bool(((min_p > 0.0) & random).any())
        presence, frequency, repetition = self.presence[:n], self.frequency[:n], self.repetition[:n]
        no_penalties = not bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
        return SamplingMetadata(
            num_reqs=n,
            temperature=self.temperature[:n].to(dev, copy=True),
            greedy_mask=greedy.to(dev),
            all_greedy=not any_random,
            all_random=bool(random.all()) and n > 0,
            # 0 (off) becomes "keep everything": a k at least the vocabulary size.
            top_k=torch.where(top_k > 0, top_k, self.vocab_size).to(dev) if use_top_k else None,
            top_p=top_p.to(dev, copy=True) if use_top_p else None,
            min_p=min_p.to(dev, copy=True) if use_min_p else None,
            generators=self._seeded_generators(n),
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else presence.to(dev, copy=True),
            frequency_penalties=None if no_penalties else frequency.to(dev, copy=True),
            repetition_penalties=None if no_penalties else repetition.to(dev, copy=True),
            prompt_token_ids=None if no_penalties else self._padded_prompts(n),
            output_token_ids=self.output_token_ids[:n],
            logit_bias=self._logit_bias_triple(n),
            num_logprobs=self.num_logprobs[:n],
            max_num_logprobs=max((k for k in self.num_logprobs[:n] if k is not None), default=None),
            allowed_token_ids=self._allowed_mask(n),
            logitsprocs=self.logitsprocs,
        )

    def _allowed_mask(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, banned [rows, vocab] bool) for the rows restricted to allowed ids; None: no row is."""
        rows = [r for r in range(n) if self.allowed_token_ids[r] is not None]
        if not rows:
            return None
        banned = torch.ones(len(rows), self.vocab_size, dtype=torch.bool)
        for i, r in enumerate(rows):
            banned[i, self.allowed_token_ids[r]] = False
        return torch.tensor(rows, dtype=torch.int64).to(self.device), banned.to(self.device)

    def _bad_word_bans(self, src: Sequence[int], outputs: Sequence[list[int]]) -> dict[int, list[int]]:
        """Metadata row i (the request in row ``src[i]``, having generated ``outputs[i]``) -> its bans."""
        bans = {}
        for i, r in enumerate(src):
            words = self.bad_words[r]
            if words is not None and (banned := ops.bad_word_bans(words, outputs[i])):
                bans[i] = banned
        return bans

    def _seeded_generators(self, n: int) -> dict[int, torch.Generator]:
        # Greedy rows never draw, so a seed on them is moot.
        return {r: g for r in range(n) if (g := self.generators[r]) is not None and not self.is_greedy[r]}

    def _min_token_bans(self, src: Sequence[int], outputs: Sequence[list[int]]) -> dict[int, list[int]]:
        """As `_bad_word_bans`: the stop ids of the rows still below min_tokens."""
        return {
            i: self.stop_ids[r]
            for i, r in enumerate(src)
            if self.min_tokens[r] and self.stop_ids[r] and len(outputs[i]) < self.min_tokens[r]
        }

    def _padded_prompts(self, n: int) -> torch.Tensor | None:
        # Only rows with a repetition penalty look at their prompt.
        rows = [self.prompt_token_ids[r] if self.repetition[r] != 1.0 else [] for r in range(n)]
        width = max((len(p) for p in rows), default=0)
        if width == 0:
            return None
        padded = torch.full((n, width), -1, dtype=torch.int64)
        for r, ids in enumerate(rows):
            if ids:
                padded[r, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return padded.to(self.device)

    def _logit_bias_triple(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for r in range(n):
            for token_id, bias in (self.logit_bias[r] or {}).items():
                rows.append(r)
                cols.append(token_id)
                vals.append(bias)
        if not rows:
            return None
        dev = self.device
        return (
            torch.tensor(rows, dtype=torch.int64, device=dev),
            torch.tensor(cols, dtype=torch.int64, device=dev),
            torch.tensor(vals, dtype=torch.float32, device=dev),
        )

    # ------------------------------------------------------------ helpers

    def _make_generator(self, seed: int, num_drawn: int = 0) -> torch.Generator:
        """A seeded generator that already made ``num_drawn`` draws: a request resumed after a preemption
        drew once per token it sampled (`ops.random_sample`; the `RejectionSampler` keeps to that), so it
        goes on with the draws it would have made had it never stopped."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for _ in range(num_drawn):
            torch.rand(1, generator=gen, device=gen.device)
        return gen

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.presence,
            self.frequency,
            self.repetition,
        )

    def _lists(self) -> tuple[list, ...]:
        return (
            self.occupied,
            self.is_greedy,
            self.min_tokens,
            self.stop_ids,
            self.generators,
            self.logit_bias,
            self.num_logprobs,
            self.prompt_token_ids,
            self.output_token_ids,
            self.allowed_token_ids,
            self.bad_words,
        )

    def _clear(self, row: int) -> None:
        # Neutral values: an empty row behaves as a greedy request with nothing switched on.
        self.temperature[row] = 1.0
        self.top_k[row] = 0
        self.top_p[row] = 1.0
        self.min_p[row] = 0.0
        self.presence[row] = 0.0
        self.frequency[row] = 0.0
        self.repetition[row] = 1.0
        self.occupied[row] = False
        self.is_greedy[row] = True
        self.min_tokens[row] = 0
        self.stop_ids[row] = []
        self.generators[row] = None
        self.logit_bias[row] = None
        self.num_logprobs[row] = None
        self.prompt_token_ids[row] = []
        self.output_token_ids[row] = []
        self.allowed_token_ids[row] = None
        self._set_bad_words(row, None)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise IndexError(f"row {row} is outside the batch of {self.max_num_reqs} rows.")


def _spread(
    owners: list[int], first: list[int], repeats: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse entries owned by rows (``owners``, one per entry) copied to each of their row's repeats:
    (the entry each copy takes, its repeated row), in row order."""
    entries = [e for e, r in enumerate(owners) for _ in range(repeats[r])]
    new_rows = [first[r] + j for r in owners for j in range(repeats[r])]
    return (
        torch.tensor(entries, dtype=torch.int64).to(device),
        torch.tensor(new_rows, dtype=torch.int64).to(device),
    )


def _copy_without_generators(md: SamplingMetadata, rows: Sequence[int]) -> SamplingMetadata:
    out = copy.copy(md)
    skip = set(rows)
    out.generators = {r: g for r, g in md.generators.items() if r not in skip}
    return out
