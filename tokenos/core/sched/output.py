"""One step between the scheduler and the worker: `SchedulerOutput` down, `ModelRunnerOutput` back up.

Pure Python. `SchedulerOutput` is what the scheduler decides for one step (tokens per request plus new
block ids per KV-cache group); `ModelRunnerOutput` is what the worker computed. (What crosses between the
frontend and the engine core is in `tokenos.core.messages`.)

How the worker reads a SchedulerOutput (the scheduler's contract; follow it literally)
---------------------------------------------------------------------------------------
Block lists. For every request the worker keeps one block-id list per KV-cache group (in the
order of `KVCacheConfig.kv_cache_groups`). Entry j of a group's list is the page of LOGICAL
COLUMN j, tokens [j * B, (j + 1) * B), B = that group's `kv_cache_spec.block_size`. Block id 0 is
the null block ("no page here"): the worker never needs to read or write it.
- `NewRequestData.block_ids`: the full list per group (it may contain 0s).
- `CachedRequestData.removed_block_idx[i]` (None: nothing removed): per group, INDICES into that
  group's list whose pages the request gave up (sliding-window columns that left the window,
  recurrent states older than the previous one); set those entries to 0. Never an index the
  step reads.
- `CachedRequestData.new_block_ids[i]` (None: nothing new): appended to each group's list.
- A request in `preempted_req_ids` or `finished_req_ids` is dropped; a preempted request comes
  back later as a NewRequestData (with its `output_token_ids`) and is rebuilt from scratch.
- `CachedRequestData.num_computed_tokens[i]` and `NewRequestData.num_computed_tokens` are the
  counts BEFORE this step (for a new request: its prefix-cache hit).

Tokens. A scheduled request with n = num_computed_tokens computes positions [n, n + k) of its
tokens (prompt then outputs), k = `num_scheduled_tokens[req_id]`. It is sampled only when
n + k reaches its token count; otherwise it returns an empty list of sampled tokens.
Speculative decoding: the last d = len(scheduled_spec_decode_tokens[req_id]) of those k positions hold
the draft tokens, after the request's known tokens. The worker samples the last d + 1 positions and
returns the drafts it accepted then one more token (1..d + 1 tokens); the scheduler takes the rejected
positions back from num_computed_tokens, so their K/V (written, never read) is overwritten later.

Attention groups (full, sliding window). Position p goes to slot p % B of page
`block_ids[g][p // B]`. A page may be shared by several requests (prefix hits), including a
page another request of the SAME step is writing (n > 1 fan-out): within every layer, write the
K/V of all tokens of the batch before any attention reads. A sliding-window layer of window W
reads keys [p - W + 1, p] only (earlier columns may already be 0).

Recurrent groups (MambaSpec: any fixed-size state). Let s = (n + k - 1) // B be the RUNNING
COLUMN ("none" mode: s = 0, and the list always holds exactly one block).
1. Before the step, for each group g -> (src, dst) in `mamba_state_copies[req_id]`, copy every
   state of every layer of group g from page `block_ids[g][src]` to page `block_ids[g][dst]`
   (dst is always s). This is checkpoint adoption: src holds the state after n tokens (a shared,
   read-only checkpoint, or the previous running page) and the copy makes the running page
   private. No entry means src == dst or n == 0: nothing to copy.
2. The initial state is page `block_ids[g][s]` if n > 0 (zeros if n == 0); the final state after
   n + k tokens is written back to that same page.
3. "all" mode only: for each block boundary b = (j + 1) * B with n < b < n + k, also write the
   state after b tokens to page `block_ids[g][j]` (one checkpoint per block).
The scheduler publishes a recurrent page as a checkpoint only after `update_from_output` saw
the step that wrote it, and never gives a published page out as a running page.

Copy-on-write prefix pages (fine-grained hybrid prefix hits, see
`tokenos.core.kv_cache.fine_prefix`, and n > 1 forks, see the scheduler). A new request whose hit
h is not a page boundary of some group g, or that forks from a running parent's state, gets, in
`prefix_page_copies[req_id][g] = (src, dst)`, a source BLOCK ID `src` (a page that is NOT in its
block list, possibly the running page another request of this step updates; the scheduler keeps it
alive until this step has run) and a COLUMN `dst` of its own list (a fresh private page). Before
anything else in the step (before `mamba_state_copies`), copy the whole page `src` into page
`block_ids[g][dst]` for every layer of group g: attention K/V (slots [0, h % B) are the prefix;
the rest is overwritten by this request before it is read) or every recurrent state (the state
after h tokens; then rule 1 above moves it on as usual). Sources are read before any write of
the step, like every copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenos.core.messages import EngineSamplingParams

# One list of block ids per KV-cache group, in group order.
BlockIds = tuple[list[int], ...]


# ---------------------------------------------------------------- scheduler -> worker


@dataclass
class NewRequestData:
    """A request the worker has not seen (or one resumed after preemption: its state is rebuilt)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams
    block_ids: BlockIds
    num_computed_tokens: int  # tokens already in the cache (prefix hit or resumed checkpoint)
    # Tokens already generated before a preemption; the worker appends them after the prompt.
    output_token_ids: list[int] = field(default_factory=list)
    # Every id that ends the request (EOS, the config's other EOS ids, the user's stop ids): the
    # sampler forbids them below min_tokens.
    eos_token_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Multi-LoRA: the key of the adapter the request runs under (None: the base model).
    adapter_id: int | str | None = None


@dataclass
class CachedRequestData:
    """Requests the worker already holds: only what changed since last step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)  # appended to each group
    num_computed_tokens: list[int] = field(default_factory=list)
    # Per group: indices into the request's block list whose entries became the null block (0)
    # (sliding window / recurrent groups dropping blocks that are no longer needed); the worker
    # rewrites those entries to 0 before appending new_block_ids. None: nothing removed.
    removed_block_idx: list[BlockIds | None] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # the worker drops these from its persistent batch
    preempted_req_ids: set[str] = field(default_factory=set)
    # Recurrent-state groups: req_id -> (group id -> (src, dst) indices into that group's block
    # list): copy page src into page dst before computing (see the module docstring).
    mamba_state_copies: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # Copy-on-write of partial prefix-hit pages: req_id -> (group id -> (src BLOCK id, dst column
    # index)): copy page src into page block_ids[g][dst] first of all (see the module docstring).
    prefix_page_copies: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # Speculative decoding: req_id -> the draft tokens scheduled after its known tokens (they are part
    # of num_scheduled_tokens). The worker computes them like any token, verifies them against the
    # target model and returns the accepted ones plus one more token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


# ---------------------------------------------------------------- worker -> scheduler


@dataclass
class TokenLogprobs:
    """Logprobs at one position: `token_ids[0]` is the chosen token, the rest the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token in the full distribution (1 = most likely)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request; empty while a request is still mid-prefill (partial chunk).
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None  # per request, per sampled token
    # req_id -> logprobs of prompt positions computed this step (position i scores token i+1).
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # req_id -> why the step failed for this request alone (its sampling); the scheduler ends it with
    # that error while every other request goes on. Failures of shared state are raised instead.
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative method "draft_model": req_id -> the drafter's proposals for the next step (vLLM's
    # take_draft_token_ids), every decoding request's; the scheduler cuts them to its limits.
    draft_token_ids: dict[str, list[int]] | None = None
