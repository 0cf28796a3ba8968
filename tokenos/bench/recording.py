"""Record what an in-process engine core's scheduler decided, step by step (benchmarks and tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenos import LLM
    from tokenos.core.sched.output import SchedulerOutput


def record_schedules(llm: LLM) -> list[SchedulerOutput]:
    """Every SchedulerOutput of `llm`'s engine core from now on, in order (clear the list to restart)."""
    scheduled: list[SchedulerOutput] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        scheduler_output = schedule()
        scheduled.append(scheduler_output)
        return scheduler_output

    scheduler.schedule = recording
    return scheduled
