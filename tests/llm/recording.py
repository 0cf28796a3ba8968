"""What the scheduler decided in a recorded run (see `tokenos.bench.recording.record_schedules`)."""

from __future__ import annotations

from tokenos.core.sched.output import SchedulerOutput


def forked_counts(scheduled: list[SchedulerOutput]) -> list[int]:
    """Tokens every request admitted with a hit (a fork or a prefix hit) did not compute."""
    hits = [n.num_computed_tokens for out in scheduled for n in out.scheduled_new_reqs]
    return sorted(h for h in hits if h)
