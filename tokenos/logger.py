"""tokenos's own log handler, as vLLM sets up its own: `import tokenos` makes the ``tokenos`` loggers
print INFO lines to stderr (engine start-up, periodic stats, offline progress), so `LLM()` in a script
says what it does without the script configuring logging. The handler is ours alone (propagate off),
so an application's root handler does not print every line twice. ``TOKENOS_CONFIGURE_LOGGING=0``
leaves logging to the application; ``TOKENOS_LOGGING_LEVEL`` sets the level (INFO).
"""

from __future__ import annotations

import logging
import os

FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging() -> None:
    if os.environ.get("TOKENOS_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("tokenos")
    if any(getattr(h, "_tokenos", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    handler._tokenos = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(os.environ.get("TOKENOS_LOGGING_LEVEL", "INFO").upper())
    root.propagate = False
