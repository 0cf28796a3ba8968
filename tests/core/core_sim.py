"""A fake worker that follows the SchedulerOutput contract in tokenos/core/sched/output.py literally,
plus an invariant checker and an engine loop, for the scheduler tests.

Pages hold fake contents: an attention page is a list of (position, token) per slot, a
recurrent page a (num_tokens, hash of the prefix) pair. The worker CHECKS what it reads (every
key in the attention window, every initial recurrent state), so a wrong block table, a wrong
copy, a premature checkpoint or a page shared by mistake shows up as an assertion.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from tokenos.config import CacheConfig, SchedulerConfig
from tokenos.core.hashing import exact_prefix_hash
from tokenos.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from tokenos.core.messages import EngineSamplingParams
from tokenos.core.request import Request, RequestStatus
from tokenos.core.sched.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenos.core.sched.scheduler import Scheduler

VOCAB = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': a function of the whole sequence (so equal prompts agree)."""
    h = zlib.crc32(bytes(t % 256 for t in tokens[-8:]) + len(tokens).to_bytes(4, "little"))
    return h % VOCAB


def state_of(tokens: list[int]) -> tuple[int, int]:
    return (len(tokens), hash(tuple(tokens)))


def attn(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 2, "float32")


def swa(block_size: int = 4, window: int = 6) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 1, 2, "float32", sliding_window=window)


def mamba(block_size: int = 4, mode: str = "align") -> MambaSpec:
    return MambaSpec(((3,),), ("float32",), block_size, mode)


def make_config(num_blocks: int, *specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


# KV-cache layouts the simulations run over (block size 4 everywhere).
LAYOUTS = {
    "full": lambda: (attn(4),),
    "sliding+full": lambda: (attn(4), swa(4, 6)),
    "hybrid-align": lambda: (attn(4), mamba(4, "align")),
    "hybrid-all": lambda: (attn(4), mamba(4, "all"), mamba(4, "all")),
    "hybrid-none": lambda: (attn(4), mamba(4, "none")),
    "sliding+mamba": lambda: (swa(4, 5), mamba(4, "align")),
    # Fine-grained hybrid prefix caching (end checkpoints on, see FINE_LAYOUTS): checkpoints every
    # 4 tokens inside 8-token attention pages, or vLLM-sized intervals plus exact-end checkpoints.
    "fine-all": lambda: (attn(8), mamba(4, "all")),
    "fine-align": lambda: (attn(8), mamba(8, "align")),
}
# Layouts run with CacheConfig(mamba_checkpoint_at_end=True).
FINE_LAYOUTS = {"fine-all", "fine-align"}


@dataclass
class _ReqState:
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int
    num_prompt: int
    want_logprobs: bool = False
    want_prompt_logprobs: bool = False


@dataclass
class FakeWorker:
    config: KVCacheConfig
    pages: dict[int, object] = field(default_factory=dict)
    reqs: dict[str, _ReqState] = field(default_factory=dict)
    num_steps: int = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        specs = [g.kv_cache_spec for g in self.config.kv_cache_groups]
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(rid, None)
        order: list[str] = []
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, "a new request the worker still holds"
            self.reqs[new.req_id] = _ReqState(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed=new.num_computed_tokens,
                num_prompt=len(new.prompt_token_ids),
                want_logprobs=new.sampling_params.logprobs is not None,
                want_prompt_logprobs=new.sampling_params.prompt_logprobs is not None,
            )
            order.append(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs[rid]
            assert st.num_computed == cached.num_computed_tokens[i], (rid, st.num_computed, cached)
            removed = cached.removed_block_idx[i] if cached.removed_block_idx else None
            if removed is not None:
                for g, idxs in enumerate(removed):
                    for j in idxs:
                        st.block_ids[g][j] = 0
            added = cached.new_block_ids[i]
            if added is not None:
                for g, ids in enumerate(added):
                    st.block_ids[g].extend(ids)
            order.append(rid)
        assert set(order) == set(out.num_scheduled_tokens)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens

        # 0. copy-on-write of partial prefix-hit pages (a block id into a column), first of all
        for rid, per_group in out.prefix_page_copies.items():
            assert rid in {n.req_id for n in out.scheduled_new_reqs}, "prefix copy for a running request"
            for g, (src_id, dst) in per_group.items():
                dst_id = self.reqs[rid].block_ids[g][dst]
                assert src_id != 0 and dst_id != 0 and src_id != dst_id
                page = self.pages.get(src_id)
                self.pages[dst_id] = list(page) if isinstance(page, list) else page
        # 1. recurrent copies (checkpoint adoption), before anything runs
        for rid in order:
            st, k = self.reqs[rid], out.num_scheduled_tokens[rid]
            n = st.num_computed
            for g, (src, dst) in out.mamba_state_copies.get(rid, {}).items():
                spec = specs[g]
                assert isinstance(spec, MambaSpec)
                assert dst == (n + k - 1) // spec.block_size, "copy destination is not the running column"
                src_id, dst_id = st.block_ids[g][src], st.block_ids[g][dst]
                assert src_id != 0 and dst_id != 0, "copy from/to the null block"
                self.pages[dst_id] = self.pages.get(src_id)
        # 2. attention writes for the whole batch
        for rid in order:
            st, k = self.reqs[rid], out.num_scheduled_tokens[rid]
            assert st.num_computed + k <= len(st.tokens)
            for g, spec in enumerate(specs):
                if isinstance(spec, MambaSpec):
                    continue
                B = spec.block_size
                for p in range(st.num_computed, st.num_computed + k):
                    bid = st.block_ids[g][p // B]
                    assert bid != 0, f"{rid}: write to the null block at position {p}"
                    page = self.pages.get(bid)
                    if not isinstance(page, list):
                        page = self.pages[bid] = [None] * B
                    page[p % B] = (p, st.tokens[p])
        # 3. reads (attention windows, recurrent states) and the recurrence itself
        sampled: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] = []
        prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        for rid in order:
            st, k = self.reqs[rid], out.num_scheduled_tokens[rid]
            n, end = st.num_computed, st.num_computed + k
            for g, spec in enumerate(specs):
                if isinstance(spec, MambaSpec):
                    self._run_recurrent(rid, st, g, spec, n, end)
                else:
                    self._check_attention(rid, st, g, spec, n, end)
            st.num_computed = end
            if st.want_prompt_logprobs and n < st.num_prompt:
                prompt_logprobs[rid] = [
                    TokenLogprobs([st.tokens[p + 1]], [-1.0], 1) if p + 1 < st.num_prompt else None
                    for p in range(n, min(end, st.num_prompt))
                ]
            if end == len(st.tokens):
                tok = next_token(st.tokens)
                st.tokens.append(tok)
                sampled.append([tok])
                logprobs.append([TokenLogprobs([tok, 1], [-0.5, -1.5], 1)] if st.want_logprobs else None)
            else:
                sampled.append([])
                logprobs.append(None)
        return ModelRunnerOutput(
            req_ids=order,
            req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _check_attention(self, rid, st, g, spec, n, end) -> None:
        B = spec.block_size
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        lo = 0 if window is None else max(0, n - window + 1)
        for q in range(lo, end):
            bid = st.block_ids[g][q // B]
            assert bid != 0, f"{rid}: key {q} needed but its column {q // B} is null (group {g})"
            page = self.pages.get(bid)
            got = page[q % B] if isinstance(page, list) else None
            assert got == (q, st.tokens[q]), f"{rid}: key {q} in block {bid} holds {got}"

    def _run_recurrent(self, rid, st, g, spec, n, end) -> None:
        B = spec.block_size
        ids = st.block_ids[g]
        if spec.cache_mode == "none":
            assert len(ids) == 1, ids
            s = 0
        else:
            s = (end - 1) // B
            assert len(ids) == s + 1, f"{rid}: {len(ids)} columns for running column {s}"
        bid = ids[s]
        assert bid != 0
        if n > 0:
            got = self.pages.get(bid)
            assert got == state_of(st.tokens[:n]), f"{rid}: initial state in block {bid} is wrong (n={n})"
        if spec.cache_mode == "all":
            for j in range(n // B, (end - 1) // B):
                b = (j + 1) * B
                if n < b < end:
                    assert ids[j] != 0
                    self.pages[ids[j]] = state_of(st.tokens[:b])
        self.pages[bid] = state_of(st.tokens[:end])


class Checker:
    """Invariants of the core after every step."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker) -> None:
        self.s = scheduler
        self.w = worker
        self.hash_to_prefix: dict[bytes, tuple[int, ...]] = {}
        self.num_hashed: dict[str, int] = {}

    def register(self) -> None:
        h = self.s.kv_cache_manager.kv_cache_config.hash_block_size
        for rid, req in self.s.requests.items():
            start = self.num_hashed.get(rid, 0)
            for i in range(start, len(req.block_hashes)):
                self.hash_to_prefix[req.block_hashes[i]] = tuple(req.all_token_ids[: (i + 1) * h])
            self.num_hashed[rid] = len(req.block_hashes)
            fine = self.s.kv_cache_manager.fine
            if fine is not None and req.num_computed_tokens:  # exact end keys (any length)
                n = req.num_computed_tokens
                key = exact_prefix_hash(fine.hash_fn, req, n, h)
                self.hash_to_prefix[key] = tuple(req.all_token_ids[:n])

    def check(self) -> None:
        kv = self.s.kv_cache_manager
        pool = kv.block_pool
        pool.check_invariants()
        refs: dict[int, int] = {}
        for m in kv.coordinator.managers:
            for rid, blocks in m.req_to_blocks.items():
                assert rid in self.s.requests, f"blocks held for a request that is gone: {rid}"
                for b in blocks:
                    if not b.is_null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
        # Copy-on-write sources are held until the request's first step has run.
        for rid, held in kv.coordinator.cow.borrowed.items():
            assert rid in self.s.requests, f"copy sources held for a request that is gone: {rid}"
            for b in held:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"{b}: {refs.get(b.block_id, 0)} holders"
        for req in self.s.requests.values():
            assert 0 <= req.num_computed_tokens <= req.num_tokens
            if req.status == RequestStatus.RUNNING:
                assert req in self.s.running
        assert len(self.s.running) <= self.s.max_num_running_reqs
        self.check_cache_contents()

    def check_cache_contents(self) -> None:
        self.register()
        specs = [g.kv_cache_spec for g in self.s.kv_cache_manager.kv_cache_config.kv_cache_groups]
        for key, block in self.s.kv_cache_manager.block_pool.cached_block_hash_to_block.items():
            h, g = key[:-4], int.from_bytes(key[-4:], "big")
            prefix = self.hash_to_prefix.get(h)
            assert prefix is not None, "a cached hash no request ever had"
            spec = specs[g]
            L = len(prefix)
            fine = self.s.kv_cache_manager.fine is not None
            assert fine or L % spec.block_size == 0
            page = self.w.pages.get(block.block_id)
            if isinstance(spec, MambaSpec):
                assert page == state_of(list(prefix)), f"checkpoint {block} does not match its prefix"
            else:
                self._check_page_prefix(block, prefix, spec.block_size)
        fine = self.s.kv_cache_manager.fine
        for key, (block, generation) in fine.sub.items() if fine is not None else ():
            if block.generation == generation:  # a live sub-page entry: its slots hold the prefix
                prefix = self.hash_to_prefix.get(key[:-4])
                assert prefix is not None, "a sub-page entry no request ever had"
                self._check_page_prefix(block, prefix, specs[int.from_bytes(key[-4:], "big")].block_size)

    def _check_page_prefix(self, block, prefix: tuple[int, ...], B: int) -> None:
        """The page holding the end of `prefix` has its last len % B (or B) tokens in slot order."""
        L = len(prefix)
        r = L % B or B
        page = self.w.pages.get(block.block_id)
        want = [(p, prefix[p]) for p in range(L - r, L)]
        got = page[:r] if isinstance(page, list) else page
        assert got == want, f"{block} holds {got}, its hash says {want}"

    def check_all_free(self) -> None:
        pool = self.s.kv_cache_manager.block_pool
        assert not self.s.requests
        assert pool.get_num_free_blocks() == pool.num_blocks - 1, "blocks leaked"
        assert pool.get_usage() == 0.0


def make_engine(*specs, at_end: bool = False, num_blocks: int = 64, budget: int = 64):
    """(scheduler, fake worker, checker) over one group per spec, up to 8 running requests."""
    cfg = make_config(num_blocks, *specs)
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
        CacheConfig(mamba_checkpoint_at_end=at_end),
        cfg,
        max_model_len=128,
    )
    w = FakeWorker(cfg)
    return s, w, Checker(s, w)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **kw) -> Request:
    sp_kw = {k: kw.pop(k) for k in list(kw) if k in EngineSamplingParams.__struct_fields__}
    return Request(rid, prompt, EngineSamplingParams(max_tokens=max_tokens, **sp_kw), eos_token_id=EOS, **kw)


def step(s: Scheduler, w: FakeWorker, checker: Checker | None = None, full_check: bool = True):
    out = s.schedule()
    if checker is not None:
        checker.register()  # before requests finish, so every published hash is known
    mo = w.execute(out)
    outs = s.update_from_output(out, mo)
    if checker is not None and full_check:
        checker.check()
    return out, outs
