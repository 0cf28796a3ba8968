"""`tokenos bench structured` on a tiny model: both runs happen and the report is complete."""

from __future__ import annotations

import argparse

import pytest

from tests.fixtures.checkpoints import save_served
from tokenos.bench import structured

pytest.importorskip("llguidance")


def test_reports_both_decode_step_times(tmp_path):
    folder = save_served("llama", str(tmp_path / "tiny"))
    parser = argparse.ArgumentParser()
    structured.add_args(parser)
    args = parser.parse_args(
        [
            "--model",
            folder,
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--dtype",
            "float32",
        ]
    )
    result = structured.run(args)
    # Both runs happened; their figures are numbers. Not their sign: a decode step is the difference of
    # two walls, which noise can invert at 4 tokens (speed is the benchmark's to report, not a test's).
    assert result["unconstrained_wall_s"] > 0 and result["constrained_wall_s"] > 0
    for key in ("unconstrained_decode_step_ms", "constrained_decode_step_ms", "mask_cost_pct"):
        assert isinstance(result[key], float), key
    assert set(result) >= {"unconstrained_wall_s", "constrained_wall_s", "mask_cost_pct"}
