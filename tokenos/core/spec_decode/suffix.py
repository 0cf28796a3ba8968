"""Suffix decoding proposer (SuffixDecoding, Oliva et al., arXiv 2411.04975; vLLM's method "suffix").

Drafts come from suffix trees of bounded depth D (`max_tree_depth`) over token sequences:

- a per-request tree over the request's prompt followed by its output so far (one sequence, so a
  match may span the prompt/output boundary and the output's own repetitions are found), and
- one global tree over responses (outputs): those of the last `max_cached_requests` forgotten requests
  (FIFO by forget order; evicting one takes its counts back out) plus the live responses of the
  requests being proposed for, added token by token as the paper and Arctic Inference's
  `add_active_response` do, so concurrent requests see each other's partial answers. Live responses do
  not count against `max_cached_requests` and are never evicted. `max_cached_requests=0`: no global tree.

Each tree is a trie in which every position i of a sequence inserts the path tokens[i : i + D]; a node
counts the occurrences that pass through it (`count`) and those that go on to a child (`total`, the sum
of the children's counts). A step's pattern is the last D tokens; the match is the longest suffix of
it (length m <= D - 1) that occurs with a follower, i.e. whose node has a child. From there the draft
follows the most frequent child (ties: the one seen most recently) while the path's estimated
probability, the running product of child.count / node.total, stays >= `min_token_prob`, for at most
min(num_speculative_tokens, max_tokens, floor(max_spec_factor * m)) tokens; the depth bound keeps
m + draft <= D. Its score is the sum of those running probabilities (the paper's); the global tree's
draft is taken only when its score is strictly higher than the request tree's (as Arctic Inference).

Where this differs from Arctic Inference (vLLM's backend), and why:
- the probability denominator is `total`, the occurrences that continue, where Arctic divides by all
  occurrences; and the match is the longest suffix with a follower, where Arctic scores every match
  length and keeps the best. The live sequence's own end always occurs in both trees with no follower
  yet: this way it neither wins the match nor halves every first probability;
- the cache holds the last max_cached_requests *finished* responses, FIFO by forget order, besides the
  live ones; Arctic counts live requests too, by start order;
- a request id reused after forget() is a new request whose predecessor's answer stays cached like
  any other (Arctic/vLLM evict it, as they key the global tree's sequences by request id).

Cost. Per-request work at a step is bounded by D and the draft length, never by the context: a new
token extends the <= D-1 open paths of its sequence (kept in a list, `_Live.active`), and the match
scans that same list. Memory stays O(tokens), not O(tokens * D): where an occurrence's path leaves
every other, the rest of it, a chain of count-1 nodes, is one `_Tail` that reads its tokens from the
sequence (open, and growing with it, until the path is D long); an occurrence that later walks into a
tail splits it one node at a time. Building the request tree is O(prompt length * shared depth),
done when the request is first proposed for; removing a response walks its O(length * D) paths.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenos.core.spec_decode.ngram import Proposable


class _Seq:
    """A sequence's tokens as tails read them: token q (an absolute position) is tokens[q - offset]."""

    __slots__ = ("tokens", "offset")

    def __init__(self, tokens: list[int] | tuple[int, ...], offset: int) -> None:
        self.tokens = tokens
        self.offset = offset


class _Node:
    """An explicit trie node. `kids` is None while it has at most one child, which is then `best`;
    with more, a dict by token, and `best` the most frequent (None: stale after a removal)."""

    __slots__ = ("token", "count", "total", "last", "best", "kids")

    def __init__(self, token: int, last: int) -> None:
        self.token = token
        self.count = 1
        self.total = 0
        self.last = last  # stamp of the latest occurrence, for the recency tie-break
        self.best: _Node | _Tail | None = None
        self.kids: dict[int, _Node | _Tail] | None = None


class _Tail:
    """The count-1 chain of an occurrence no other shares: nodes for seq positions pos .. stop - 1.
    Open (`live` is its sequence) while the occurrence still grows: each append moves `stop` on."""

    __slots__ = ("token", "last", "seq", "pos", "stop", "live")
    count = 1

    def __init__(self, seq: _Seq, pos: int, stop: int, last: int, live: _Live | None) -> None:
        self.token = seq.tokens[pos - seq.offset]
        self.last = last
        self.seq = seq
        self.pos = pos
        self.stop = stop
        self.live = live


_Child = _Node | _Tail
# A place in a tree: an explicit node (position None), or a tail and the position of its token there.
_Loc = tuple[_Child, int | None]


def _child(node: _Node, token: int) -> _Child | None:
    kids = node.kids
    if kids is None:
        only = node.best
        return only if only is not None and only.token == token else None
    return kids.get(token)


def _rank(child: _Child) -> tuple[int, int]:
    return child.count, child.last


def _best(node: _Node) -> _Child | None:
    best = node.best
    if best is None and node.kids:  # stale since a removal: recompute only when read
        best = node.best = max(node.kids.values(), key=_rank)
    return best


def _promote(node: _Node, child: _Child) -> None:
    """After child's count grew by an occurrence newer than any other: it wins ties."""
    best = node.best
    if best is not None and best is not child and child.count >= best.count:
        node.best = child


def _attach(node: _Node, child: _Child) -> None:
    kids = node.kids
    if kids is None:
        only = node.best
        if only is None:
            node.best = child
            return
        node.kids = {only.token: only, child.token: child}
    else:
        kids[child.token] = child
    _promote(node, child)


def _replace(node: _Node, old: _Child, new: _Child) -> None:
    if node.kids is None:
        node.best = new
        return
    node.kids[new.token] = new
    if node.best is old:
        node.best = new


def _detach(node: _Node, child: _Child) -> None:
    kids = node.kids
    if kids is None:
        node.best = None
        return
    del kids[child.token]
    if node.best is child:
        node.best = None


def _split(node: _Node, tail: _Tail, stamp: int) -> _Node:
    """A second occurrence reaches tail's first token: make that token an explicit node of count 2."""
    head = _Node(tail.token, stamp)
    head.count = 2
    if tail.pos + 1 < tail.stop:
        tail.pos += 1
        seq = tail.seq
        tail.token = seq.tokens[tail.pos - seq.offset]
        head.best = tail  # its stale `last` is older than any sibling it will get: ties stay right
        head.total = 1
    elif tail.live is not None:  # an open tail used up: its occurrence's path now ends at head
        active = tail.live.active
        active[active.index(tail)] = head
    _replace(node, tail, head)
    return head


class _Live:
    """A sequence that may still grow: positions [start, end) of seq are inserted; active[L - 1] is
    where the path of its last L tokens ends, for L = 1 .. min(end - start, D - 1) (the paths still
    open): an explicit node, or an open tail when no other occurrence shares the path's end."""

    __slots__ = ("seq", "start", "end", "active")

    def __init__(self, seq: _Seq, start: int) -> None:
        self.seq = seq
        self.start = start
        self.end = start
        self.active: list[_Child] = []


class _Tree:
    __slots__ = ("root", "depth")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(-1, -1)
        self.root.kids = {}  # always a dict, `best` unused: no draft starts at the root

    def build(self, live: _Live, tokens: list[int]) -> None:
        """Insert a whole sequence at once (seq offset 0, stamps = positions, which ascend as the
        recency tie-break needs): complete paths with closed tails, the open ones with open tails."""
        depth, n, seq = self.depth, len(tokens), live.seq
        for i in range(live.start, n - depth + 1):
            self._insert(seq, i, i + depth, None)
        first = max(live.start, n - depth + 1)
        live.end = n
        # By length; an open path is only ever split by shorter ones, never used up (see _split),
        # so none is looked up here before it is stored.
        live.active = active = [self.root] * (n - first)
        for i in range(first, n):
            active[n - i - 1] = self._insert(seq, i, n, live)

    def _insert(self, seq: _Seq, i: int, stop: int, live: _Live | None) -> _Child:
        """Occurrence i (tokens [i, stop)) from the root; where its path ends."""
        tokens = seq.tokens
        node = self.root
        for q in range(i, stop):
            child = _descend(node, tokens[q], q)
            if child is None:  # the rest of this occurrence is new: one tail reads it from seq
                tail = _Tail(seq, q, stop, q, live)
                _attach(node, tail)
                return tail
            node = child
        return node

    def _grow(self, node: _Node, live: _Live, token: int, stamp: int) -> _Child:
        """live's open path at node goes on to token (at position live.end)."""
        child = _descend(node, token, stamp)
        if child is None:
            child = _Tail(live.seq, live.end, live.end + 1, stamp, live)
            _attach(node, child)
        return child

    def append(self, live: _Live, token: int, stamp: int) -> None:
        """The sequence grows by token: every open path, and a new one from the root, extend by it."""
        grown = [self._grow(self.root, live, token, stamp)]
        # Read live.active as it changes: splitting another path's open tail to its end hands that
        # path over to the new node (_split), and such a path comes later in this list.
        for node in live.active:
            if node.__class__ is _Tail:  # open and unshared: it grows with the sequence for free
                node.stop += 1
                grown.append(node)
                continue
            # The common shared case of _grow, inlined: this runs up to D times a token.
            kids = node.kids
            if kids is None:
                child = node.best
                if child is not None and child.token != token:
                    child = None
            else:
                child = kids.get(token)
            if child is not None and child.__class__ is _Node:
                node.total += 1
                child.count += 1
                child.last = stamp
                best = node.best
                if best is not child and best is not None and child.count >= best.count:
                    node.best = child
            else:
                child = self._grow(node, live, token, stamp)
            grown.append(child)
        live.end += 1
        if len(grown) == self.depth:  # the oldest open path reached depth D: complete
            done = grown.pop()
            if done.__class__ is _Tail:
                done.live = None
            elif done.count == 1:  # explicit and unshared (an eviction took the other): compact it
                self.compact(live.seq, live.end - self.depth, live.end)
        live.active = grown

    def compact(self, seq: _Seq, i: int, stop: int) -> None:
        """Replace the unshared (count-1) end of occurrence i's complete path by a tail."""
        tokens, offset = seq.tokens, seq.offset
        node = self.root
        for q in range(i, stop):
            child = _child(node, tokens[q - offset])
            if child.__class__ is _Tail:
                return
            if child.count == 1:
                _replace(node, child, _Tail(seq, q, stop, child.last, None))
                return
            node = child

    def freeze(self, live: _Live) -> None:
        """The sequence ended: its open paths are complete."""
        for length, node in enumerate(live.active, 1):
            if node.__class__ is _Tail:
                node.live = None
            elif node.count == 1:
                self.compact(live.seq, live.end - length, live.end)
        live.active = []

    def remove(self, live: _Live) -> None:
        """Take a frozen sequence's occurrences back out; nodes left with no occurrence go."""
        seq, depth, end = live.seq, self.depth, live.end
        tokens, offset = seq.tokens, seq.offset
        for i in range(live.start, end):
            node = self.root
            for q in range(i, min(i + depth, end)):
                node.total -= 1
                child = _child(node, tokens[q - offset])
                if child.__class__ is _Tail:  # this occurrence's own tail (count 1)
                    _detach(node, child)
                    break
                child.count -= 1
                if child.count == 0:  # only this occurrence went there: the whole subtree goes
                    _detach(node, child)
                    break
                if child is node.best and node.kids is not None:
                    node.best = None  # it may have lost the lead
                node = child

    def find(self, tokens: list[int], lo: int, hi: int) -> _Loc | None:
        """Where the path tokens[lo:hi] ends, if it is in the tree."""
        node: _Child = self.root
        pos: int | None = None
        for j in range(lo, hi):
            token = tokens[j]
            if pos is None:
                child = _child(node, token)
                if child is None:
                    return None
                node = child
                if child.__class__ is _Tail:
                    pos = child.pos
            else:
                pos += 1
                seq = node.seq
                if pos >= node.stop or seq.tokens[pos - seq.offset] != token:
                    return None
        return node, pos


def _continues(loc: _Loc) -> bool:
    node, pos = loc
    return node.total > 0 if pos is None else pos + 1 < node.stop


def _longest_match(tree: _Tree, live: _Live, tokens: list[int]) -> tuple[int, _Loc | None]:
    """The longest suffix of tokens (<= D - 1) with a follower in tree, and where it ends. live's open
    nodes give the suffixes it holds for free; longer ones (a response's suffixes that reach into
    the prompt) are looked up, which happens only in a response's first D - 1 tokens."""
    n = len(tokens)
    active = live.active
    for length in range(min(n, tree.depth - 1), 0, -1):
        if length <= len(active):
            node = active[length - 1]
            if node.__class__ is _Node and node.total:  # an open tail is this sequence's alone
                return length, (node, None)
        else:
            loc = tree.find(tokens, n - length, n)
            if loc is not None and _continues(loc):
                return length, loc
    return 0, None


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    """A speculation: its tokens, score (sum of the running path probabilities), the match length it
    came from and the tree ("prompt": the request's own, "global": earlier and live responses)."""

    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    tree: str = ""


class _Request:
    __slots__ = ("tokens", "tree", "local", "response")

    def __init__(self, tokens: list[int], depth: int) -> None:
        self.tokens = tokens  # the request's live list, as last seen
        self.tree = _Tree(depth)
        self.local = _Live(_Seq(tokens, 0), 0)
        self.response: _Live | None = None  # its output in the global tree (None: no global tree)


class SuffixProposer:
    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {max_tree_depth}.")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}.")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}.")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}.")
        self.k = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _Request] = {}
        self._global = _Tree(max_tree_depth) if max_cached_requests > 0 else None
        self._cached: deque[_Live] = deque()  # forgotten responses in the global tree, oldest first
        self._clock = 0  # global-tree stamps: one per response token added, so newer is larger

    def propose(self, request: Proposable, max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens to follow request.all_token_ids."""
        return self.speculate(request, max_tokens).token_ids

    def speculate(self, request: Proposable, max_tokens: int) -> SuffixDraft:
        """`propose`, with the draft's score, match length and tree."""
        state = self._sync(request)
        limit = min(self.k, max_tokens)
        if limit <= 0:
            return SuffixDraft()
        tokens = state.tokens
        draft = self._draft(state.tree, state.local, tokens, limit, "prompt")
        if state.response is not None:
            other = self._draft(self._global, state.response, tokens, limit, "global")
            if other.score > draft.score:
                draft = other
        return draft

    def forget(self, request_id: str) -> None:
        """The request ended: its response stays in the global tree (up to the newest
        max_cached_requests such), its own tree goes."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._retire(state)

    def _sync(self, request: Proposable) -> _Request:
        """The request's trees, brought up to its current tokens."""
        tokens = request.all_token_ids
        state = self._requests.get(request.request_id)
        if state is not None and len(tokens) < state.local.end:
            # Not the sequence the trees hold (the list only grows): retire it, start afresh.
            del self._requests[request.request_id]
            self._retire(state)
            state = None
        if state is None:
            state = self._requests[request.request_id] = _Request(tokens, self.max_tree_depth)
            state.tree.build(state.local, tokens)
            if self._global is not None:
                prompt = request.num_prompt_tokens
                state.response = _Live(_Seq([], prompt), prompt)
        else:
            state.tokens = state.local.seq.tokens = tokens
            for q in range(state.local.end, len(tokens)):
                state.tree.append(state.local, tokens[q], q)
        self._add_response_tokens(state)
        return state

    def _add_response_tokens(self, state: _Request) -> None:
        live = state.response
        if live is None:
            return
        # The response keeps its own copy: its tails must outlive the request's list.
        own, tokens, append = live.seq.tokens, state.tokens, self._global.append
        for q in range(live.end, len(tokens)):
            token = tokens[q]
            own.append(token)
            self._clock += 1
            append(live, token, self._clock)

    def _retire(self, state: _Request) -> None:
        live = state.response
        if live is None:
            return
        self._add_response_tokens(state)  # what came after the last proposal
        live.seq.tokens = tuple(live.seq.tokens)
        self._global.freeze(live)
        self._cached.append(live)
        while len(self._cached) > self.max_cached_requests:
            self._global.remove(self._cached.popleft())

    def _draft(self, tree: _Tree, live: _Live, tokens: list[int], limit: int, name: str) -> SuffixDraft:
        match_len, loc = _longest_match(tree, live, tokens)
        if loc is None:
            return SuffixDraft()
        cap = min(limit, int(match_len * self.max_spec_factor + 1e-6))  # epsilon: 0.1 * 30 is 3
        token_ids, score = self._walk(loc, cap) if cap > 0 else ([], 0.0)
        return SuffixDraft(token_ids, score, match_len, name)

    def _walk(self, loc: _Loc, cap: int) -> tuple[list[int], float]:
        """Follow the most frequent continuation from loc while its running probability holds."""
        node, pos = loc
        out: list[int] = []
        prob, score = 1.0, 0.0
        min_prob = self.min_token_prob
        while len(out) < cap:
            if pos is None:
                if not node.total:
                    break
                child = _best(node)
                p = prob * child.count / node.total
                if p < min_prob:
                    break
                prob = p
                out.append(child.token)
                node = child
                if child.__class__ is _Tail:
                    pos = child.pos
            else:  # along a tail each node has one child of the same count: prob holds
                pos += 1
                if pos >= node.stop:
                    break
                seq = node.seq
                out.append(seq.tokens[pos - seq.offset])
            score += prob
        return out, score


def _descend(node: _Node, token: int, stamp: int) -> _Node | None:
    """One more occurrence passes through node on to token: count it and return that child (a tail in
    the way is split first), or None when node has no such child yet (the caller attaches one)."""
    node.total += 1
    child = _child(node, token)
    if child is None:
        return None
    if child.__class__ is _Tail:
        child = _split(node, child, stamp)
    else:
        child.count += 1
        child.last = stamp
    _promote(node, child)
    return child
