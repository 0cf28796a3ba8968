"""tokenos/platform.py: thread count for the cores this process may use, and the CPU summary logged
at start-up."""

from __future__ import annotations

import os

import pytest
import torch

from tokenos import platform


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_tokenos_num_threads_wins(monkeypatch, restore_threads):
    monkeypatch.setenv("TOKENOS_NUM_THREADS", "1")
    assert platform.configure_threads() == 1 == torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity masks here")
def test_threads_capped_at_the_affinity_mask(monkeypatch, restore_threads):
    monkeypatch.delenv("TOKENOS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    torch.set_num_threads(2)
    assert platform.configure_threads() == 1


def test_cpu_summary_names_the_extensions_the_kernels_use():
    summary = platform.cpu_summary()
    flags = summary[summary.index("[") + 1 : -1].split()
    assert set(flags) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "no", "AVX2"}
    if platform.native_bf16_supported():
        assert "avx512_bf16" in flags or "amx_bf16" in flags
