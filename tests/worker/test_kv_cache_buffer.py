"""The pool's byte buffer: zeroed, and (on Linux with THP in madvise or always mode) backed by huge pages,
even in a process whose heap already holds freed, faulted memory."""

from __future__ import annotations

import sys

import pytest
import torch

from tokenos.worker.kv_cache import zeroed_buffer


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def test_buffer_is_zeroed():
    buf = zeroed_buffer(3 << 20)
    assert buf.numel() == 3 << 20 and int(buf.count_nonzero()) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's transparent huge pages")
def test_buffer_asks_for_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off")
    heap = [torch.ones(64 << 20, dtype=torch.uint8) for _ in range(2)]  # faulted, then freed, heap memory
    del heap
    before = _anon_huge_kib()
    buf = zeroed_buffer(64 << 20)
    buf.fill_(1)  # pages are faulted in (as huge pages) when first written, as the KV cache's are
    assert _anon_huge_kib() - before >= 32 << 10, "a 64 MiB pool got under 32 MiB of huge pages"
    del buf
