"""Suffix decoding proposer: against a scan-based reference of the same definition (over random
workloads of interleaved requests, forgets, id reuse and evictions), incremental against built from
scratch, the trees' invariants, and the behaviours the method is for (copying from the prompt,
reusing earlier answers) with each cap.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.scheduler_sim import make_request
from tokenos.core.spec_decode.suffix import SuffixDraft, SuffixProposer, _Node, _Tail, _Tree


class Reference:
    """The definition, by scanning: occurrences of a context in held sequences, counted directly.

    Recency stamps mirror what the proposer sees: positions in the request's own sequence, and in the
    global tree one tick per response token in the order tokens reach the proposer (when the request
    is proposed for or forgotten). Evicted responses still count for recency (the latest time a
    continuation was seen), not for frequency."""

    def __init__(self, k: int, depth: int, max_cached: int, factor: float, min_prob: float) -> None:
        self.k, self.depth, self.max_cached = k, depth, max_cached
        self.factor, self.min_prob = factor, min_prob
        self.live: dict[str, tuple[object, list[int], list[int]]] = {}
        self.cached: deque[tuple[list[int], list[int]]] = deque()
        self.evicted: list[tuple[list[int], list[int]]] = []
        self.clock = 0

    def _sync(self, req) -> tuple[list[int], list[int]]:
        if req.request_id not in self.live:
            self.live[req.request_id] = (req, [], [])
        _, resp, stamps = self.live[req.request_id]
        if self.max_cached:
            for token in req.all_token_ids[req.num_prompt_tokens + len(resp) :]:
                self.clock += 1
                resp.append(token)
                stamps.append(self.clock)
        return resp, stamps

    def forget(self, rid: str) -> None:
        if rid not in self.live:
            return
        resp, stamps = self._sync(self.live[rid][0])
        del self.live[rid]
        if self.max_cached:
            self.cached.append((resp, stamps))
            while len(self.cached) > self.max_cached:
                self.evicted.append(self.cached.popleft())

    def speculate(self, req, max_tokens: int) -> SuffixDraft:
        self._sync(req)
        limit = min(self.k, max_tokens)
        if limit <= 0:
            return SuffixDraft()
        tokens = req.all_token_ids
        draft = self._draft([(tokens, list(range(len(tokens))), True)], tokens, limit, "prompt")
        if self.max_cached:
            held = [(r, s, True) for _, r, s in self.live.values()] + [(r, s, True) for r, s in self.cached]
            seqs = held + [(r, s, False) for r, s in self.evicted]
            other = self._draft(seqs, tokens, limit, "global")
            if other.score > draft.score:
                draft = other
        return draft

    def _follows(self, seqs, ctx: list[int]) -> tuple[dict[int, int], dict[int, int]]:
        """What follows each occurrence of ctx: counts (held sequences) and latest stamp (all)."""
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        if len(ctx) >= self.depth:  # a path is at most depth tokens, ctx included
            return counts, last
        n = len(ctx)
        for tokens, stamps, held in seqs:
            for i in range(len(tokens) - n):
                if tokens[i : i + n] == ctx:
                    c = tokens[i + n]
                    if held:
                        counts[c] = counts.get(c, 0) + 1
                    last[c] = max(last.get(c, -1), stamps[i + n])
        return counts, last

    def _draft(self, seqs, tokens: list[int], limit: int, name: str) -> SuffixDraft:
        n = len(tokens)
        match = next(
            (m for m in range(min(n, self.depth - 1), 0, -1) if self._follows(seqs, tokens[n - m :])[0]), 0
        )
        if match == 0:
            return SuffixDraft()
        cap = min(limit, int(match * self.factor + 1e-6))
        ctx, out, prob, score = list(tokens[n - match :]), [], 1.0, 0.0
        while len(out) < cap:
            counts, last = self._follows(seqs, ctx)
            if not counts:
                break
            c = max(counts, key=lambda t: (counts[t], last[t]))
            p = prob * counts[c] / sum(counts.values())
            if p < self.min_prob:
                break
            prob = p
            out.append(c)
            score += prob
            ctx.append(c)
        return SuffixDraft(out, score, match, name)


def children(node: _Node) -> list:
    if node.kids is not None:
        return list(node.kids.values())
    return [node.best] if node.best is not None else []


def check_tree(tree: _Tree) -> None:
    """Counts add up, the recorded best child is the most frequent (then latest), tails read right."""
    stack = [(tree.root, 0)]
    while stack:
        node, depth = stack.pop()
        kids = children(node)
        assert node.total == sum(c.count for c in kids)
        assert depth < tree.depth or not kids
        if node.kids is not None:
            assert all(t == c.token for t, c in node.kids.items())
            if node is not tree.root and node.best is not None:
                assert node.best is max(kids, key=lambda c: (c.count, c.last))
        for c in kids:
            assert c.count >= 1
            if isinstance(c, _Tail):
                seq = c.seq
                assert c.token == seq.tokens[c.pos - seq.offset] and c.pos < c.stop
                assert depth + c.stop - c.pos <= tree.depth
                if c.live is not None:  # open: its sequence's to grow
                    assert c.stop == c.live.end and any(x is c for x in c.live.active)
            else:
                stack.append((c, depth + 1))


def paths(tree: _Tree) -> dict[tuple[int, ...], int]:
    """Every path in the tree (tails unrolled) with its count."""
    out: dict[tuple[int, ...], int] = {}
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for c in children(node):
            if isinstance(c, _Tail):
                seq, path = c.seq, prefix
                for q in range(c.pos, c.stop):
                    path = (*path, seq.tokens[q - seq.offset])
                    out[path] = 1
            else:
                path = (*prefix, c.token)
                out[path] = c.count
                stack.append((c, path))
    return out


def substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for tokens in seqs:
        for i in range(len(tokens)):
            for j in range(i + 1, min(i + depth, len(tokens)) + 1):
                key = tuple(tokens[i:j])
                out[key] = out.get(key, 0) + 1
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_proposer_is_the_scan_based_definition(data):
    """Interleaved requests over a tiny vocabulary (so matches, ties and thresholds all happen):
    every draft, its match length, score and tree equal the reference's; the trees stay consistent."""
    vocab = data.draw(st.integers(2, 4), label="vocab")
    depth = data.draw(st.integers(1, 6), label="depth")
    k = data.draw(st.integers(1, 5), label="k")
    max_cached = data.draw(st.integers(0, 3), label="max_cached")
    factor = data.draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]), label="factor")
    min_prob = data.draw(st.sampled_from([0.0, 0.1, 0.3, 0.6]), label="min_prob")
    proposer = SuffixProposer(k, depth, max_cached, factor, min_prob)
    ref = Reference(k, depth, max_cached, factor, min_prob)
    tokens = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)
    reqs: dict[str, object] = {}
    for _ in range(data.draw(st.integers(1, 20), label="ops")):
        rid = f"r{data.draw(st.integers(0, 2))}"
        if rid in reqs and data.draw(st.integers(0, 2)) == 0:
            proposer.forget(rid)
            ref.forget(rid)
            del reqs[rid]
            continue
        if rid not in reqs:
            reqs[rid] = make_request(rid, data.draw(tokens))  # a reused id is a new request
        req = reqs[rid]
        req.append_output_token_ids(data.draw(st.lists(st.integers(0, vocab - 1), max_size=4)))
        max_tokens = data.draw(st.integers(-1, 6))
        assert proposer.speculate(req, max_tokens) == ref.speculate(req, max_tokens)
        for state in proposer._requests.values():
            check_tree(state.tree)
        if proposer._global is not None:
            check_tree(proposer._global)
    if proposer._global is not None:
        held = [r.all_token_ids[r.num_prompt_tokens :] for r in reqs.values()] + [r for r, _ in ref.cached]
        assert paths(proposer._global) == substring_counts(held, depth)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.integers(1, 7),
    st.booleans(),
)
def test_growing_token_by_token_is_building_from_scratch(prompt, output, depth, with_global):
    """After every appended token, the incrementally kept trees hold exactly the sequences' bounded
    substrings and propose what a new proposer that first sees the request there proposes."""
    max_cached = 2 if with_global else 0
    live = SuffixProposer(3, depth, max_cached, 2.0, 0.1)
    req = make_request("r", prompt)
    for token in output:
        drafted = live.speculate(req, 5)
        fresh = make_request("r", prompt)
        fresh.append_output_token_ids(req.output_token_ids)
        assert drafted == SuffixProposer(3, depth, max_cached, 2.0, 0.1).speculate(fresh, 5)
        assert paths(live._requests["r"].tree) == substring_counts([req.all_token_ids], depth)
        if with_global:
            assert paths(live._global) == substring_counts([req.output_token_ids], depth)
        req.append_output_token_ids(token)


def test_output_copying_its_prompt_gets_the_prompt_continuation():
    passage = list(range(100, 140))
    req = make_request("r", [1, 2, 3, *passage, 4, 5, 6])
    proposer = SuffixProposer(5, max_cached_requests=0)
    assert proposer.propose(req, 10) == []  # the prompt's end does not recur
    req.append_output_token_ids(passage[:6])  # the model starts quoting the passage
    assert proposer.propose(req, 10) == passage[6:11]
    draft = proposer.speculate(req, 10)
    assert (draft.match_len, draft.score, draft.tree) == (6, 5.0, "prompt")
    req.append_output_token_ids(passage[6:9])  # two accepted drafts in one step
    assert proposer.propose(req, 10) == passage[9:14]


def test_a_second_request_gets_the_first_ones_answer():
    prompt, answer = [1, 2, 3, 4], list(range(50, 80))
    proposer = SuffixProposer(8)
    first = make_request("a", prompt)
    proposer.propose(first, 10)
    first.append_output_token_ids(answer)
    proposer.forget("a")  # the last tokens arrived after its last proposal: taken at forget
    second = make_request("b", prompt)
    second.append_output_token_ids(answer[0])
    # The match is one token: max_spec_factor 1.0 allows one draft token, then the match grows.
    assert proposer.speculate(second, 10) == SuffixDraft([answer[1]], 1.0, 1, "global")
    second.append_output_token_ids(answer[1:4])
    assert proposer.propose(second, 10) == answer[4:8]
    second.append_output_token_ids(answer[4:12])
    assert proposer.propose(second, 10) == answer[12:20]  # now num_speculative_tokens caps it
    assert proposer.propose(second, 3) == answer[12:15]  # and max_tokens


def test_live_responses_are_shared_but_only_forgotten_ones_count_against_the_cache():
    proposer = SuffixProposer(4, max_cached_requests=1)
    a, b = make_request("a", [1, 2]), make_request("b", [3, 4])
    a.append_output_token_ids([60, 61, 62, 63, 64, 65])
    proposer.propose(a, 4)
    b.append_output_token_ids([60, 61, 62])
    assert proposer.propose(b, 4) == [63, 64, 65]  # from a's answer while a still runs
    proposer.forget("a")
    proposer.forget("b")  # b's answer is newer: a's goes
    c = make_request("c", [5])
    c.append_output_token_ids([62, 63])
    assert proposer.propose(c, 4) == []  # 62 63 was followed only in a's answer
    c.append_output_token_ids([60, 61])
    assert proposer.propose(c, 4) == [62]  # b's answer: 60 61 62 and nothing after


def answer(proposer: SuffixProposer, rid: str, output: list[int]) -> None:
    req = make_request(rid, [9])
    req.append_output_token_ids(output)
    proposer.propose(req, 4)
    proposer.forget(rid)


def test_eviction_forgets_the_oldest_answer_and_its_counts():
    proposer = SuffixProposer(4, max_cached_requests=2)
    for i, output in enumerate([[7, 8, 1], [7, 8, 2], [7, 8, 2]]):
        answer(proposer, f"q{i}", output)
    assert len(proposer._cached) == 2
    probe = make_request("p", [5])
    probe.append_output_token_ids([7, 8])
    assert proposer.speculate(probe, 4) == SuffixDraft([2], 1.0, 2, "global")  # 1 went with q0
    assert paths(proposer._global) == substring_counts([[7, 8, 2], [7, 8, 2], [7, 8]], 24)
    check_tree(proposer._global)


def test_eviction_can_hand_the_lead_to_another_continuation():
    proposer = SuffixProposer(4, max_cached_requests=3)
    for i, output in enumerate([[7, 8, 1], [7, 8, 1], [7, 8, 2], [7, 8, 3]]):
        answer(proposer, f"q{i}", output)  # at q3's forget 1 (twice) leads, then q0 goes
    probe = make_request("p", [5])
    probe.append_output_token_ids([7, 8])
    assert proposer.speculate(probe, 4) == SuffixDraft([3], 1 / 3, 2, "global")  # three ties: latest
    check_tree(proposer._global)


def test_max_tree_depth_bounds_match_plus_draft():
    seq = list(range(20))
    req = make_request("r", seq + [99] + seq[:3])
    deep = SuffixProposer(10, max_tree_depth=24, max_spec_factor=10.0, max_cached_requests=0)
    assert deep.speculate(req, 10) == SuffixDraft(seq[3:13], 10.0, 3, "prompt")
    shallow = SuffixProposer(10, max_tree_depth=5, max_spec_factor=10.0, max_cached_requests=0)
    assert shallow.propose(req, 10) == seq[3:5]  # 3 matched + 2 drafted = depth 5
    req.append_output_token_ids(seq[3:6])
    assert shallow.speculate(req, 10) == SuffixDraft([seq[6]], 1.0, 4, "prompt")  # match capped at 4


def test_max_spec_factor_scales_the_draft_with_the_match():
    req = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2])
    for factor, expected in [(0.4, []), (0.5, [3]), (1.0, [3, 4]), (2.5, [3, 4, 5, 6, 7])]:
        proposer = SuffixProposer(8, max_spec_factor=factor, max_cached_requests=0)
        assert proposer.propose(req, 8) == expected
        assert proposer.speculate(req, 8).match_len == 2


def test_min_token_prob_cuts_the_draft_where_the_path_gets_unlikely():
    # After 5: 6 twice, 7 and 8 once each (6 is 1/2); after 5 6: 1 then 2 or 3 (each 1/2 of that).
    req = make_request("r", [5, 6, 1, 2, 5, 6, 1, 3, 5, 7, 0, 5, 8, 0, 9, 5])
    for min_prob, expected in [(0.6, []), (0.5, [6, 1]), (0.3, [6, 1]), (0.25, [6, 1, 3, 5])]:
        proposer = SuffixProposer(4, max_spec_factor=4.0, max_cached_requests=0, min_token_prob=min_prob)
        assert proposer.propose(req, 4) == expected
    # 5 6 1 2 and 5 6 1 3 tie once each: the latest (3) wins; 5 6 1 3 goes on with 5 at 1/4 still.
    draft = SuffixProposer(4, max_spec_factor=4.0, min_token_prob=0.0).speculate(req, 4)
    assert draft == SuffixDraft([6, 1, 3, 5], 0.5 + 0.5 + 0.25 + 0.25, 1, "prompt")


def test_forget_then_reuse_of_an_id_starts_fresh():
    proposer = SuffixProposer(4, max_cached_requests=0)
    old = make_request("r", [1, 2, 3, 1, 2])
    assert proposer.propose(old, 4) == [3, 1]
    proposer.forget("r")
    proposer.forget("r")  # twice, or for a request never proposed for: nothing
    new = make_request("r", [4, 1, 2])
    assert proposer.propose(new, 4) == []  # nothing of the old prompt
    assert proposer._requests["r"].tokens is new.all_token_ids
    # With a global tree, the old request's answer is an earlier answer like any other.
    shared = SuffixProposer(4)
    old = make_request("r", [0])
    old.append_output_token_ids([1, 2, 3])
    shared.propose(old, 4)
    shared.forget("r")
    new = make_request("r", [4, 1, 2])
    assert shared.speculate(new, 4) == SuffixDraft([3], 1.0, 2, "global")


def test_arguments_are_checked():
    for kwargs in [
        {"max_tree_depth": 0},
        {"max_cached_requests": -1},
        {"max_spec_factor": -1.0},
        {"min_token_prob": 1.5},
    ]:
        with pytest.raises(ValueError):
            SuffixProposer(4, **kwargs)


def test_a_long_prompt_costs_nodes_in_proportion_to_its_length():
    """Unshared path ends are tails: a 2,000-token prompt is a few thousand objects, not 2,000 * 24;
    so is a long output, prompt tree and global tree alike."""
    rng = random.Random(0)
    phrases = [rng.sample(range(50), 20) for _ in range(10)]
    for prompt in (
        [rng.randrange(32000) for _ in range(2000)],
        [t for _ in range(100) for t in rng.choice(phrases)],  # 10 phrases of 20 over 50 ids, repeated
    ):
        proposer = SuffixProposer(4)
        req = make_request("r", prompt)
        proposer.propose(req, 4)
        tree = proposer._requests["r"].tree
        assert sum(1 for _ in walk(tree)) < 6 * len(prompt)
        check_tree(tree)
    for _ in range(300):
        req.append_output_token_ids([rng.randrange(32000) for _ in range(rng.randrange(1, 4))])
        proposer.propose(req, 4)
    assert sum(1 for _ in walk(tree)) < 6 * len(req.all_token_ids)
    assert sum(1 for _ in walk(proposer._global)) < 6 * req.num_output_tokens
    check_tree(tree)
    check_tree(proposer._global)
    proposer.forget("r")  # its open paths are complete now: no explicit node is left unshared
    shared = proposer._global
    assert all(n.count > 1 for n in walk(shared) if isinstance(n, _Node) and n is not shared.root)


def walk(tree: _Tree):
    stack = [tree.root]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _Node):
            stack.extend(children(node))
