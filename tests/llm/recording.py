"""Record what the engine core's scheduler decided, step by step, for assertions on scheduling."""

from __future__ import annotations

from tokenos import LLM
from tokenos.core.outputs import SchedulerOutput


def record_schedules(llm: LLM) -> list[SchedulerOutput]:
    """Every SchedulerOutput of the in-process engine core from now on, in order."""
    scheduled: list[SchedulerOutput] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        so = schedule()
        scheduled.append(so)
        return so

    scheduler.schedule = recording
    return scheduled


def forked_counts(scheduled: list[SchedulerOutput]) -> list[int]:
    """Tokens every request admitted with a hit (a fork or a prefix hit) did not compute."""
    hits = [n.num_computed_tokens for so in scheduled for n in so.scheduled_new_reqs]
    return sorted(h for h in hits if h)
