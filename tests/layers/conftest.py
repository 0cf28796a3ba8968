"""Fixtures of the layer tests."""

from __future__ import annotations

import pytest

from tokenos.layers import cpu_kernels


@pytest.fixture(params=["native", "x86-64-v3"])
def kernel_build(request, monkeypatch):
    """The C kernels as built for this CPU, and as the AVX2-only build (TOKENOS_KERNEL_MARCH) that CPUs
    without AVX-512 run: the fp8 and int8 widenings have a separate vector path in each."""
    if request.param != "native":
        flags = tuple(f"-march={request.param}" if f.startswith("-march=") else f for f in cpu_kernels.CFLAGS)
        monkeypatch.setattr(cpu_kernels, "CFLAGS", flags)
    cpu_kernels.load.cache_clear()
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the C decode kernel could not be built")
    yield request.param
    monkeypatch.undo()
    cpu_kernels.load.cache_clear()
