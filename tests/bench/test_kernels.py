"""`tokenos bench kernels` (tokenos/bench/kernels.py): every section runs on tiny shapes and reports
a positive rate against the limits it measured."""

from __future__ import annotations

import argparse

from tokenos.bench import kernels


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernels.add_args(parser)
    tiny = ["--batches", "2", "--contexts", "40", "--rows", "1", "3", "--hidden", "64"]
    tiny += ["--intermediate", "96", "--vocab", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    tiny += "--cascade-groups 2 --cascade-members 3 --cascade-prefix 64 --cascade-own 1 20".split()
    return parser.parse_args(tiny + list(argv))


def test_decode_attention_over_fp8_pages(monkeypatch):
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 10.0)
    monkeypatch.setattr(kernels, "timed", lambda fn, **_: (fn(), 1e-3)[1])
    rows = kernels.run(_args("--sections", "decode", "--kv-cache-dtype", "fp8"))
    assert rows and all(row["kv"] == "float8_e4m3fn" and row["GB_s"] > 0 for row in rows)


def test_decode_attention_over_int8_pages(monkeypatch):
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 10.0)
    monkeypatch.setattr(kernels, "timed", lambda fn, **_: (fn(), 1e-3)[1])
    rows = kernels.run(_args("--sections", "decode", "--kv-cache-dtype", "int8"))
    assert rows and all(row["kv"] == "int8" and row["GB_s"] > 0 for row in rows)


def test_every_section_reports_a_positive_rate(monkeypatch):
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 10.0)  # the real one streams 256 MiB
    monkeypatch.setattr(kernels, "gemm_peak", lambda dtype: 100.0)
    monkeypatch.setattr(kernels, "timed", lambda fn, **_: (fn(), 1e-3)[1])
    rows = kernels.run(_args("--dtype", "float32"))
    names = {row["kernel"] for row in rows}
    assert {"copy", "gemm_2048"} <= names
    assert any(name.startswith("decode") for name in names), names
    assert any(name.startswith("prefill") for name in names), names
    cascade = [(row["own"], row["resident"]) for row in rows if row["kernel"] == "cascade_decode"]
    assert sorted(cascade) == [(1, False), (1, True), (20, False), (20, True)]
    # Two row counts x five shapes x dense / int8 / int4 weights.
    assert sum(row["kernel"].startswith("linear") for row in rows) == 2 * 5 * 3, names
    assert {row["weights"] for row in rows if "weights" in row} == {"dense", "int8", "int4"}
    for row in rows:
        rate = row.get("GB_s", row.get("GFLOP_s"))
        assert rate is not None and rate > 0, row
        assert row["dtype"] == "float32"
    assert all("pct_bandwidth" in row for row in rows if "GB_s" in row and row["kernel"] != "copy")


def test_decode_attention_is_held_against_the_copy_measured_beside_it(monkeypatch):
    """Its % is of the copy GB/s measured in turn with its own calls, not of the limits' earlier copy."""
    copies = iter([10.0, 30.0, 20.0, 40.0, 50.0, 20.0])  # the limits' copy, then five beside the kernel
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: next(copies))
    monkeypatch.setattr(kernels, "gemm_peak", lambda dtype: 100.0)
    monkeypatch.setattr(kernels, "timed", lambda fn, **_: (fn(), 1e-3)[1])
    rows = kernels.run(_args("--sections", "limits", "decode", "--dtype", "float32"))
    copy, decode = rows[0], rows[2]
    assert copy["GB_s"] == 10.0 and decode["copy_GB_s"] == 30.0  # the median of the five beside it
    assert decode["pct_bandwidth"] == round(100 * decode["GB_s"] / 30.0, 2)


def test_max_kv_gib_skips_shapes_too_large():
    rows = kernels.run(_args("--sections", "decode", "--max-kv-gib", "0", "--dtype", "float32"))
    assert rows == []


def test_cascade_tables_share_each_groups_prefix_pages_only():
    tables = kernels.cascade_tables(groups=2, members=3, prefix=40, own=20, block=16)
    assert len(tables) == 6 and all(len(t) == 3 + 2 for t in tables)
    prefixes = [tuple(t[:3]) for t in tables]
    assert prefixes[:3] == [prefixes[0]] * 3 and prefixes[3:] == [prefixes[3]] * 3
    assert not set(prefixes[0]) & set(prefixes[3])
    owns = [page for t in tables for page in t[3:]]
    assert len(owns) == len(set(owns)) and not set(owns) & set(prefixes[0] + prefixes[3])
    assert 0 not in {page for t in tables for page in t}  # page 0 is the null block


def test_cascade_decode_counts_each_prefix_once(monkeypatch):
    monkeypatch.setattr(kernels, "timed", lambda fn, **_: (fn(), 1e-3)[1])
    args = _args("--sections", "cascade")
    rows = kernels.run(args)
    assert len(rows) == 4
    row_bytes = 2 * 2 * 16 * (2 if rows[0]["dtype"] == "bfloat16" else 4)  # K and V, 2 KV heads of 16
    for row in rows:
        kv_bytes = (2 * 64 + 2 * 3 * row["own"]) * row_bytes
        # a streamed call walks as many layers' caches as overflow the LLC; timed() covers them all
        layers = 1 if row["resident"] else min(kernels.MAX_COPIES, -(-kernels.LLC_BYTES // kv_bytes))
        assert row["GB_s"] == round(kv_bytes * layers / 1e-3 / 1e9, 2), row


def test_each_call_drops_its_output_before_the_next(monkeypatch):
    """The linear and cascade sections walk many copies; a copy's output must be freed before the next
    call, as between a model's layers (held, 19 gate_up outputs of 12.6 MB made every call fault in
    fresh pages, and the section reported a third of the kernel's speed)."""
    import weakref

    alive, most = set(), [0]

    class Output:
        pass

    def call(item: int) -> Output:
        out = Output()
        alive.add(item)
        weakref.finalize(out, alive.discard, item)
        most[0] = max(most[0], len(alive))
        return out

    kernels.call_each(call, list(range(5)))
    assert most[0] == 1 and not alive

    monkeypatch.setattr(kernels, "timed", lambda fn, **_: (fn(), 1e-3)[1])
    for section in ("linear", "cascade"):
        walked = []
        monkeypatch.setattr(kernels, "call_each", lambda fn, items, seen=walked: seen.append(len(items)))
        kernels.run(_args("--sections", section, "--weights", "int4"))
        assert walked, f"the {section} section walks its copies through call_each"
