"""Progress of a long offline `generate`: a tqdm bar on a terminal (with vLLM's speed estimates), and a
plain log line every ``TOKENOS_PROGRESS_INTERVAL_S`` seconds (10) otherwise, so a job whose stderr goes
to a file or a CI log still shows that it moves."""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger("tokenos.llm")


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.start = time.perf_counter()
        self.interval = float(os.environ.get("TOKENOS_PROGRESS_INTERVAL_S", "10"))
        self.last_line = self.start
        self.bar = None
        self.enabled = enabled and total > 1
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def update(self, prompt_tokens: int, output_tokens: int) -> None:
        """One request finished, with its prompt and generated token counts."""
        self.done += 1
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        inp, out = self.prompt_tokens / elapsed, self.output_tokens / elapsed
        speed = f"input: {inp:.1f} toks/s, output: {out:.1f} toks/s"
        if self.bar is not None:
            self.bar.set_postfix_str(f"est. speed {speed}", refresh=False)
            self.bar.update(1)
        elif time.perf_counter() - self.last_line >= self.interval or self.done == self.total:
            self.last_line = time.perf_counter()
            if elapsed >= self.interval:  # a short call stays quiet
                logger.info(
                    "Processed prompts: %d/%d (%.0f%%) in %.1fs, est. speed %s",
                    self.done,
                    self.total,
                    100 * self.done / self.total,
                    elapsed,
                    speed,
                )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
