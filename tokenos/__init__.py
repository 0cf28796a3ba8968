"""tokenos: an operating system for tokens (LLM inference and serving)."""

__version__ = "0.1.0"

from tokenos.logger import configure_logging  # noqa: E402
from tokenos.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

configure_logging()

__all__ = ["SamplingParams", "RequestOutputKind", "LLM", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import tokenos` (and the pure core) light.
    if name == "LLM":
        from tokenos.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
