"""The adapters one engine serves: registered by name, loaded in a bounded table, applied per step.

- ``register(name, path)`` reads and checks the adapter against the model (`tokenos.lora.adapter`) and
  names it; ``unregister(name)`` forgets the name (requests already running keep their weights).
- ``acquire(name)`` is called when a request arrives: it pins the adapter (loading it again from its
  folder if it was evicted, refusing it if the files changed since it was registered) and returns the
  key the request carries; ``release(key)`` when the request is gone.
- The table holds every pinned adapter plus at most ``max_cpu_loras`` idle ones, least recently used
  leaving first; the scheduler keeps the adapters of one step at ``max_loras``.
- ``set_step(segments, num_tokens)`` gives the adapted linears this step's segments (`LoRAStep`), and
  says when they should run one adapter merged into their weights: once every token of
  ``MERGE_AFTER_STEPS`` steps in a row used the same adapter (a merge costs about a decode step's worth
  of weight traffic, so a batch that switches adapters every step never pays it), and from then on at
  once for as long as that adapter's merged copies are the ones held.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from tokenos.config import LoRAConfig
from tokenos.layers.linear import Linear
from tokenos.lora.adapter import AdapterInfo, ModuleWeights, load_adapter
from tokenos.lora.layers import LoRALayer, LoRAStep

logger = logging.getLogger(__name__)

# Steps in a row that one adapter must have to itself before its merged copies are made.
MERGE_AFTER_STEPS = 8


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.step = LoRAStep()
        self.registered: dict[str, AdapterInfo] = {}  # name -> the adapter requests naming it get
        self.loaded: OrderedDict[str, dict[str, ModuleWeights]] = OrderedDict()  # key -> weights (LRU)
        self.pins: dict[str, int] = {}
        self.layers: dict[str, LoRALayer] = {}
        self.merged: str | None = None  # the adapter whose merged copies the layers hold
        # The adapter that had every token of the last steps (None: none did), and for how many steps.
        self.single: tuple[str | None, int] = (None, 0)

    # ------------------------------------------------------------ names

    def register(self, name: str, path: str) -> AdapterInfo:
        """Load and check the adapter in ``path`` under ``name``; ValueError saying what is wrong."""
        if name in self.registered:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded: unload it first.")
        info, weights = load_adapter(path, name, self.model, self.config.max_lora_rank, self.dtype)
        self.registered[name] = info
        self._install(info.key, weights)
        self._evict_idle()
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %d modules)", name, info.path, info.rank, len(weights)
        )
        return info

    def unregister(self, name: str) -> bool:
        info = self.registered.pop(name, None)
        if info is None:
            return False
        if not self.pins.get(info.key):
            self._drop_weights(info.key)
        return True

    def list(self) -> list[AdapterInfo]:
        return list(self.registered.values())

    # ------------------------------------------------------------ requests

    def acquire(self, name: str) -> str:
        """Pin the adapter ``name`` for a new request; its key. ValueError for an unknown name."""
        info = self.registered.get(name)
        if info is None:
            known = ", ".join(sorted(self.registered)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known}).")
        key = info.key
        if key not in self.loaded:
            self._reload(info)
        self.loaded.move_to_end(key)
        self.pins[key] = self.pins.get(key, 0) + 1
        return key

    def release(self, key: str) -> None:
        count = self.pins.get(key, 0) - 1
        if count > 0:
            self.pins[key] = count
            return
        self.pins.pop(key, None)
        if not any(info.key == key for info in self.registered.values()):
            self._drop_weights(key)  # unloaded (or replaced) while requests still used it
        else:
            self._evict_idle()

    def _reload(self, info: AdapterInfo) -> None:
        now, weights = load_adapter(info.path, info.name, self.model, self.config.max_lora_rank, self.dtype)
        if now.content_hash != info.content_hash:
            raise ValueError(
                f"LoRA adapter {info.name!r} changed on disk since it was loaded from {info.path}: "
                "unload and load it again to serve the new weights."
            )
        self._install(info.key, weights)
        self._evict_idle()

    # ------------------------------------------------------------ the table

    def _install(self, key: str, weights: dict[str, ModuleWeights]) -> None:
        for module, w in weights.items():
            self._layer(module).add(key, w)
        self.loaded[key] = weights
        self.loaded.move_to_end(key)

    def _layer(self, module: str) -> LoRALayer:
        layer = self.layers.get(module)
        if layer is None:
            linear = self.model.get_submodule(module)
            assert isinstance(linear, Linear)
            layer = self.layers[module] = LoRALayer(self.step, linear)
            linear.lora = layer
        return layer

    def _evict_idle(self) -> None:
        idle = [k for k in self.loaded if not self.pins.get(k)]  # least recently used first
        for key in idle[: max(len(idle) - self.config.max_cpu_loras, 0)]:
            self._drop_weights(key)

    def _drop_weights(self, key: str) -> None:
        for module in self.loaded.pop(key, {}):
            self.layers[module].drop(key)
        if self.merged == key:
            self.merged = None

    # ------------------------------------------------------------ a step

    def set_step(self, segments: list[tuple[str, int, int]], num_tokens: int) -> None:
        """This step's (key, start token, end token) segments over its ``num_tokens`` tokens; every key
        must be pinned (loaded)."""
        for key, _, _ in segments:
            if key not in self.loaded:
                raise RuntimeError(f"LoRA adapter {key} is scheduled but not loaded")
        self.step.set(segments, self._merged_for(segments, num_tokens))

    def _merged_for(self, segments: list[tuple[str, int, int]], num_tokens: int) -> str | None:
        """The adapter this step runs merged, if any (see the module's docstring)."""
        alone = len(segments) == 1 and segments[0][2] - segments[0][1] == num_tokens
        only = segments[0][0] if alone else None
        last, count = self.single
        self.single = (only, count + 1 if only == last else 1)
        if only is None or not self.config.merge_single_adapter:
            return None
        if only != self.merged and self.single[1] < MERGE_AFTER_STEPS:
            return None
        if only != self.merged:
            logger.info("LoRA adapter %s alone for %d steps: running it merged", only, MERGE_AFTER_STEPS)
            self.merged = only
        return only
