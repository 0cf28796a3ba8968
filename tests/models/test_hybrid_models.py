"""Hybrid and recurrent models (Mamba2, Bamba, Qwen3-Next, GraniteMoeHybrid, Falcon-H1, NemotronH) vs
transformers,
over a real paged pool.

The harness plays the worker by hand, literally following the SchedulerOutput contract of
``tokenos/core/sched/output.py``: block lists per KV-cache group from one shuffled free list, the running
recurrent column ``s = (n + k - 1) // B``, ``(src, dst)`` state copies before the step, old recurrent
columns given back after it, prefix-hit adoption of a checkpoint page. The pool is the one the engine
builds (``get_kv_cache_config`` + ``allocate_kv_caches``), so pages are padded and views strided exactly as
in serving. Every test compares logits (float32, tight tolerance) with transformers' pure-torch forward on
the same tokens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import FullAttentionSpec, MambaSpec, get_kv_cache_config
from tokenos.layers.attention_metadata import build_attention_metadata
from tokenos.layers.metadata import ForwardBatch
from tokenos.models import build_model, load_model_config
from tokenos.worker.kv_cache import allocate_kv_caches
from tokenos.worker.recurrent import (
    apply_state_copies,
    boundary_pages,
    build_recurrent_batch,
    group_layer_indices,
    running_block_ids,
    running_column,
)

VOCAB = 64


def _hf_config(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "mamba2":
        return transformers.Mamba2Config(
            num_heads=4,
            head_dim=8,
            hidden_size=16,
            expand=2,
            state_size=8,
            n_groups=2,
            chunk_size=8,
            conv_kernel=4,
            num_hidden_layers=2,
            initializer_range=0.2,
            **common,
        )
    if family == "bamba":
        # Attention in the middle; 4 Mamba heads of 16 in 2 groups; partial rotary 0.5 of head_dim 8.
        return transformers.BambaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
            max_position_embeddings=256,
            initializer_range=0.2,
            **common,
        )
    if family == "qwen3_next":
        # MoE on layers 0 and 1, a dense MLP on layer 2; partial rotary 0.25 of head_dim 16.
        return transformers.Qwen3NextConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_only_layers=[2],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            max_position_embeddings=256,
            initializer_range=0.2,
            **common,
        )
    if family.startswith("granitemoehybrid"):
        # muP multipliers all away from 1; "granitemoehybrid": 4 experts (top 2) beside the shared MLP and
        # rotary attention in the middle; "_dense": no experts, attention first and without rotary ("nope",
        # what Granite 4.0-H checkpoints say).
        moe = family == "granitemoehybrid"
        return transformers.GraniteMoeHybridConfig(
            hidden_size=32,
            intermediate_size=16,
            shared_intermediate_size=24,
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"] if moe else ["attention", "mamba", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4 if moe else 0,
            num_experts_per_tok=2,
            position_embedding_type="rope" if moe else "nope",
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            logits_scaling=2.0,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
            max_position_embeddings=256,
            initializer_range=0.2,
            **common,
        )
    if family.startswith("falcon_h1"):
        # Every muP multiplier away from 1. "falcon_h1": no norm in the mixer (y * silu(z), the config's
        # default); "_norm": grouped RMSNorm before the gate, tied embeddings, head_dim != hidden / heads.
        norm = family == "falcon_h1_norm"
        return transformers.FalconH1Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **({"head_dim": 16} if norm else {}),
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            mamba_rms_norm=norm,
            mamba_norm_before_gate=True,
            embedding_multiplier=2.0,
            lm_head_multiplier=0.5,
            mlp_multipliers=[0.7, 1.3],
            key_multiplier=1.5,
            attention_in_multiplier=0.8,
            attention_out_multiplier=1.2,
            ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6],
            ssm_in_multiplier=1.1,
            ssm_out_multiplier=0.9,
            max_position_embeddings=256,
            initializer_range=0.2,
            **{**common, "tie_word_embeddings": norm},
        )
    if family == "nemotron_h":
        # One block of every kind: Mamba2, attention (no rotary), relu2 MLP, MoE (8 experts in 2 groups of
        # 4, top 2 from the best group, scaled by 2.5, plus a shared expert), Mamba2 again.
        return transformers.NemotronHConfig(
            hidden_size=32,
            intermediate_size=48,
            hybrid_override_pattern="M*-EM",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            max_position_embeddings=256,
            initializer_range=0.2,
            **common,
        )
    raise KeyError(family)


def _perturb(model: torch.nn.Module) -> None:
    """Move norms, biases, D and dt_bias off their init values so loading mistakes show up."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".D", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(-1, 1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # NemotronH's router: a buffer, but checkpointed
                b.normal_(0, 0.5)


def save_tiny(family: str, folder: str, perturb: bool = True, **overrides) -> torch.nn.Module:
    """The tiny random float32 transformers model of `family` (seed 0, config `overrides` applied,
    perturbed unless told not to), saved to `folder` as a Hugging Face checkpoint; returns it."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if perturb:
        _perturb(ref)
    ref.save_pretrained(folder)
    return ref


@pytest.fixture(
    scope="module",
    params=[
        "mamba2",
        "bamba",
        "qwen3_next",
        "granitemoehybrid",
        "granitemoehybrid_dense",
        "falcon_h1",
        "falcon_h1_norm",
        "nemotron_h",
    ],
)
def family(request, tmp_path_factory):
    """(family, our model, transformers model) on the same tiny random float32 checkpoint."""
    folder = str(tmp_path_factory.mktemp(request.param))
    ref = save_tiny(request.param, folder)
    ours = build_model(load_model_config(folder, dtype="float32", max_model_len=256))
    return request.param, ours, ref


def hf_logits(ref: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens]), use_cache=False).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff < rel * scale, f"max |logit diff| {diff:.3g} exceeds {rel} x scale {scale:.3g}"


class PoolRunner:
    """Drives a hybrid model over the engine's paged pool, playing scheduler and worker by the contract."""

    def __init__(
        self, model, block_size: int = 16, num_blocks: int = 48, mode: str = "align", seed: int = 0
    ) -> None:
        self.model = model
        specs = model.get_kv_cache_spec(CacheConfig(block_size=block_size, mamba_cache_mode=mode))
        self.config = get_kv_cache_config(
            specs, available_memory_bytes=None, num_blocks=num_blocks, max_model_len=256
        )
        self.layer_order = list(specs)
        self.kv_caches = allocate_kv_caches(self.config, self.layer_order)
        self.groups = self.config.kv_cache_groups
        group_of = {name: g for g, grp in enumerate(self.groups) for name in grp.layer_names}
        self.entry_groups = [group_of[name] for name in self.layer_order]
        self.group_layers = group_layer_indices(self.config, self.layer_order)
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.pinned: set[int] = set()  # published checkpoint pages: never given back
        self.num_greedy: dict[str, int] = {}  # trailing tokens of a request that were our greedy picks

    # -- scheduler side: block lists and copies
    def _alloc(self) -> int:
        return self.free.pop()

    def _grow(self, req: str, n: int, k: int) -> dict[int, tuple[int, int]]:
        lists = self.blocks.setdefault(req, [[] for _ in self.groups])
        copies = {}
        for g, group in enumerate(self.groups):
            spec, lst = group.kv_cache_spec, lists[g]
            if isinstance(spec, MambaSpec):
                s = running_column(n, k, spec.block_size, spec.cache_mode)
                lst.extend([0] * (s + 1 - len(lst)))
                # "all" mode: a page for every column this step reaches (its boundary checkpoints).
                first = n // spec.block_size if spec.cache_mode == "all" else s
                for j in range(first, s + 1):
                    if lst[j] == 0:
                        lst[j] = self._alloc()
                src = running_column(n, 0, spec.block_size, spec.cache_mode)
                if spec.cache_mode != "none" and n > 0 and src != s:
                    copies[g] = (src, s)
            else:
                while len(lst) * spec.block_size < n + k:
                    lst.append(self._alloc())
        return copies

    def _publish_and_release(self, req: str) -> None:
        """After a step: a step ending on a block boundary publishes its running page as a checkpoint
        (align mode); recurrent pages before the running column go back to the pool unless published."""
        n = self.computed[req]
        for g, group in enumerate(self.groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec) and spec.cache_mode == "align":
                lst = self.blocks[req][g]
                if n % spec.block_size == 0:
                    self.pinned.add(lst[n // spec.block_size - 1])
                for j in range(running_column(n, 0, spec.block_size)):
                    if lst[j] and lst[j] not in self.pinned:
                        self.free.insert(0, lst[j])
                        lst[j] = 0

    def adopt(self, req: str, src_req: str, num_tokens: int) -> None:
        """A prefix hit of ``num_tokens`` (a block boundary) on ``src_req``'s pages: attention pages shared,
        the recurrent checkpoint page of column ``num_tokens // B - 1`` shared (read-only) and pinned."""
        lists = []
        for g, group in enumerate(self.groups):
            bs = group.kv_cache_spec.block_size
            assert num_tokens % bs == 0
            src = self.blocks[src_req][g]
            if isinstance(group.kv_cache_spec, MambaSpec):
                j = num_tokens // bs - 1
                assert src[j] != 0
                self.pinned.add(src[j])
                lists.append([0] * j + [src[j]])
            else:
                lists.append(list(src[: num_tokens // bs]))
        self.blocks[req] = lists
        self.computed[req] = num_tokens
        self.tokens[req] = list(self.tokens[src_req][:num_tokens])

    # -- worker side: copies, metadata, forward
    def step(self, work: list[tuple[str, list[int]]]) -> None:
        reqs = [r for r, _ in work]
        n = np.array([self.computed.setdefault(r, 0) for r in reqs], dtype=np.int64)
        k = np.array([len(t) for _, t in work], dtype=np.int64)
        copies = {
            r: c for r, ni, ki in zip(reqs, n, k, strict=True) if (c := self._grow(r, int(ni), int(ki)))
        }
        apply_state_copies(copies, lambda r, g: self.blocks[r][g], self.group_layers, self.kv_caches)
        qsl = np.concatenate([[0], np.cumsum(k)])
        metas = []
        for g, group in enumerate(self.groups):
            spec, lists = group.kv_cache_spec, [self.blocks[r][g] for r in reqs]
            if isinstance(spec, MambaSpec):
                running = running_block_ids(lists, n, k, spec.block_size, spec.cache_mode)
                pages = boundary_pages(lists, n, k, spec.block_size) if spec.cache_mode == "all" else None
                metas.append(build_recurrent_batch(qsl, n, k, running, pages, spec.block_size))
            else:
                metas.append(build_attention_metadata(lists, n.tolist(), k.tolist(), spec.block_size))
        ids = torch.tensor([t for _, toks in work for t in toks])
        pos = torch.cat([torch.arange(a, a + b) for a, b in zip(n.tolist(), k.tolist(), strict=True)])
        batch = ForwardBatch.for_groups(ids, pos, self.kv_caches, metas, self.entry_groups)
        logits = self.model.compute_logits(self.model(batch))
        for (r, toks), a, b in zip(work, qsl[:-1], qsl[1:], strict=True):
            self.logits.setdefault(r, []).append(logits[a:b])
            self.tokens.setdefault(r, []).extend(toks)
            self.computed[r] += len(toks)
            self._publish_and_release(r)

    def greedy(self, req: str) -> int:
        return int(self.logits[req][-1][-1].argmax())

    def request_logits(self, req: str) -> torch.Tensor:
        return torch.cat(self.logits[req])

    # -- memory inspection
    def buffers(self) -> list[torch.Tensor]:
        """The pool's flat byte buffers, each viewed ``[num_blocks, page_bytes]``."""
        seen = {}
        for cache in self.kv_caches:
            for view in cache if isinstance(cache, list) else [cache]:
                base = view._base if view._base is not None else view
                seen[base.data_ptr()] = base.view(torch.uint8).view(self.config.num_blocks, -1)
        return list(seen.values())

    def owned(self, reqs: list[str]) -> set[int]:
        return {b for r in reqs for lst in self.blocks.get(r, []) for b in lst if b}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def run_chunks(runner: PoolRunner, plan: dict[str, tuple[list[int], list[int]]]) -> None:
    """Interleave requests: plan[req] = (tokens, chunk sizes); step i runs every request's i-th chunk."""
    done = dict.fromkeys(plan, 0)
    for i in range(max(len(sizes) for _, sizes in plan.values())):
        work = []
        for req, (toks, sizes) in plan.items():
            if i < len(sizes):
                work.append((req, toks[done[req] : done[req] + sizes[i]]))
                done[req] += sizes[i]
        runner.step(work)


def decode_greedy(runner: PoolRunner, reqs: list[str], steps: int) -> None:
    for _ in range(steps):
        runner.step([(r, [runner.greedy(r)]) for r in reqs])
    for r in reqs:
        runner.num_greedy[r] = runner.num_greedy.get(r, 0) + steps


def check_request(runner: PoolRunner, ref, req: str, first: int = 0) -> None:
    """Our logits for every position the request computed == transformers' on its whole token list, and
    every greedy token we fed back is transformers' argmax too."""
    tokens = runner.tokens[req]
    want = hf_logits(ref, tokens)[first:]
    got = runner.request_logits(req)
    assert_close(got, want)
    m = runner.num_greedy.get(req, 0)
    if m:
        assert want[-m - 1 : -1].argmax(-1).tolist() == tokens[-m:]


def test_kv_cache_spec_and_unified_block_size(family):
    name, model, _ = family
    specs = model.get_kv_cache_spec(CacheConfig(block_size=16))
    assert list(specs) == [name for name, _ in model.cache_layers()]
    kinds = {type(s) for s in specs.values()}
    assert MambaSpec in kinds and (FullAttentionSpec in kinds) == (name != "mamba2")
    config = get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=32, max_model_len=256)
    sizes = {g.kv_cache_spec.block_size for g in config.kv_cache_groups}
    # One block size for every group after unification: recurrent boundaries line up with attention's.
    assert len(sizes) == 1
    assert {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups} == {config.page_size_bytes}
    if name in ("bamba", "granitemoehybrid", "granitemoehybrid_dense", "falcon_h1", "nemotron_h"):
        assert sizes == {32}  # one Mamba state (3200 B) needs two 16-token attention pages of 1 KiB
    else:
        assert sizes == {16}


def test_chunked_prefill_two_requests_then_decode(family):
    """Odd chunks crossing block boundaries, two requests per step, then greedy decode for both."""
    _, model, ref = family
    runner = PoolRunner(model, seed=1)
    run_chunks(
        runner,
        {
            "a": (prompt(1, 75), [7, 13, 1, 20, 11, 23]),
            "b": (prompt(2, 41), [30, 1, 1, 9]),
        },
    )
    decode_greedy(runner, ["a", "b"], 5)
    for req in ("a", "b"):
        check_request(runner, ref, req)


def test_resume_from_checkpoint_page(family):
    """A request adopts another's block-boundary checkpoint (copied into its own running page) and
    computes only its suffix, in the same steps as the producer keeps going."""
    _, model, ref = family
    runner = PoolRunner(model, seed=2)
    bs = runner.groups[0].kv_cache_spec.block_size
    shared = prompt(3, 2 * bs)
    run_chunks(runner, {"a": (shared + prompt(4, 9), [bs - 3, bs + 3, 9])})  # step 2 ends on 2 * bs
    runner.adopt("c", "a", 2 * bs)
    suffix = prompt(5, 19)
    runner.step([("a", [runner.greedy("a")]), ("c", suffix[:6])])
    runner.step([("c", suffix[6:]), ("a", [runner.greedy("a")])])
    decode_greedy(runner, ["c", "a"], 3)
    check_request(runner, ref, "a")
    check_request(runner, ref, "c", first=2 * bs)
    # The adopted checkpoint is still intact for the next consumer: resume a third request from it.
    runner.adopt("d", "a", 2 * bs)
    runner.step([("d", suffix[:1]), ("c", [runner.greedy("c")])])
    check_request(runner, ref, "d", first=2 * bs)


def test_none_mode_single_page(family):
    """ "none" mode: one recurrent page for the whole request, never copied."""
    _, model, ref = family
    runner = PoolRunner(model, mode="none", seed=4)
    run_chunks(runner, {"a": (prompt(6, 37), [5, 17, 15]), "b": (prompt(7, 20), [20])})
    decode_greedy(runner, ["a", "b"], 2)
    for g in runner.group_layers:
        assert len(runner.blocks["a"][g]) == 1
    for req in ("a", "b"):
        check_request(runner, ref, req)


def test_all_mode_checkpoints_every_block(family):
    """ "all" mode: one prefill chunk crossing several boundaries (and a decode landing on one) leaves a
    checkpoint in every block's page; a request resumed from each of them matches transformers."""
    _, model, ref = family
    runner = PoolRunner(model, mode="all", num_blocks=64, seed=6)
    bs = runner.groups[0].kv_cache_spec.block_size
    toks = prompt(11, 3 * bs)
    run_chunks(runner, {"a": (toks, [5, 2 * bs + 4, bs - 10, 1])})  # boundaries bs and 2 * bs inside a chunk
    assert runner.computed["a"] == 3 * bs  # the last one-token step ends on 3 * bs
    check_request(runner, ref, "a")
    for j in (1, 2, 3):
        runner.adopt(f"r{j}", "a", j * bs)
    suffix = prompt(12, 7)
    runner.step([(f"r{j}", suffix[: 2 + j]) for j in (1, 2, 3)])
    for j in (1, 2, 3):
        check_request(runner, ref, f"r{j}", first=j * bs)


def _fill(buffers: list[torch.Tensor], pages, salt: int) -> None:
    """A distinct byte per (buffer, page); byte values 1..60 are small finite float32/bfloat16 numbers."""
    for i, buf in enumerate(buffers):
        for b in pages:
            buf[b].fill_(1 + (b * 7 + i * 13 + salt) % 60)


def _changed_pages(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    out = set()
    for x, y in zip(before, after, strict=True):
        out |= set(torch.nonzero((x != y).any(dim=1)).flatten().tolist())
    return out


def test_writes_stay_in_owned_pages(family):
    """Fill every page with a pattern, run steps, and check only the scheduled requests' pages change
    (through any layer's view: attention K/V, conv and SSM states, state copies)."""
    _, model, ref = family
    runner = PoolRunner(model, seed=5)
    num_blocks = runner.config.num_blocks
    buffers = runner.buffers()
    _fill(buffers, range(num_blocks), salt=0)  # new requests must not care what their pages held

    idle = prompt(8, 23)
    runner.step([("idle", idle)])  # a request that stays in the pool but is not scheduled again
    a, b = prompt(9, 50), prompt(10, 30)
    steps = [[("a", a[:21]), ("b", b[:17])], [("b", b[17:]), ("a", a[21:40])], [("a", a[40:])]]
    for work in steps:
        reqs = [r for r, _ in work]
        free = set(range(num_blocks)) - runner.owned(["a", "b", "idle"])
        _fill(buffers, sorted(free), salt=len(runner.free))
        before = [buf.clone() for buf in buffers]
        runner.step(work)
        changed = _changed_pages(before, buffers)
        # Pages allocated this step are owned now; pages released after it were owned during it.
        allowed = (
            runner.owned(reqs)
            | (free - set(runner.free) - runner.owned(["idle"]))
            | (set(runner.free) - free)
        )
        assert 0 not in changed, "a write landed in the null block"
        assert changed <= allowed, (
            f"pages {sorted(changed - allowed)} changed but no scheduled request owns them"
        )
        assert not changed & runner.owned(["idle"])
    for req in ("a", "b", "idle"):
        check_request(runner, ref, req)
