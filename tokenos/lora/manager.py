"""The adapters one engine serves: registered by name, loaded in a bounded table, applied per step.

- ``register(name, path)`` reads and checks the adapter against the model (`tokenos.lora.adapter`) and
  names it; ``unregister(name)`` forgets the name (requests already submitted keep their adapter).
- ``acquire(name)`` is called when a request arrives: it returns the key the request carries and counts
  the request as the adapter's (refusing an unknown name, or files changed on disk since registration);
  ``release(key)`` when the request is gone. Arrival loads nothing: a waiting request holds no weights.
- ``activate(key)`` / ``deactivate(key)`` are called by the worker as a request enters and leaves the
  running batch: an adapter's weights are loaded (again, from its folder, if they were evicted) when its
  first request runs. The table holds the adapters of running requests (at most ``max_loras``, which
  the scheduler keeps) plus at most ``max_cpu_loras`` idle ones, least recently used leaving first: on a
  CPU the slot table and host memory are one, so an evicted adapter goes back to its folder.
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
from tokenos.lora.adapter import AdapterInfo, ModuleWeights, content_hash, load_adapter
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
        # key -> (its adapter, live requests carrying it, waiting or running): the adapter stays known
        # to them after it is unregistered.
        self.refs: dict[str, tuple[AdapterInfo, int]] = {}
        self.active: dict[str, int] = {}  # key -> requests in the running batch (weights pinned)
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
        if not self.active.get(info.key):
            self._drop_weights(info.key)  # waiting requests, if any, reload it from its folder
        return True

    def list(self) -> list[AdapterInfo]:
        return list(self.registered.values())

    # ------------------------------------------------------------ requests

    def acquire(self, name: str) -> str:
        """Count a new request as adapter ``name``'s; its key. ValueError for an unknown name, or files
        changed on disk since the adapter was registered (checked when they are not loaded)."""
        info = self.registered.get(name)
        if info is None:
            known = ", ".join(sorted(self.registered)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known}).")
        if info.key not in self.loaded and info.key not in self.refs:
            self._check_unchanged(info, content_hash(info.path))
        self.refs[info.key] = (info, self.refs.get(info.key, (info, 0))[1] + 1)
        return info.key

    def release(self, key: str) -> None:
        info, count = self.refs.pop(key, (None, 0))
        if count > 1:
            self.refs[key] = (info, count - 1)
            return
        if not self._registered(key):
            self._drop_weights(key)  # unloaded (or replaced) while requests still used it
        else:
            self._evict_idle()

    def activate(self, key: str) -> None:
        """A request carrying ``key`` joins the running batch: its weights are loaded, and stay while it
        runs. ValueError (that request fails alone) if its files changed on disk since registration."""
        if key not in self.loaded:
            self._reload(self.refs[key][0])
        self.loaded.move_to_end(key)
        self.active[key] = self.active.get(key, 0) + 1

    def deactivate(self, key: str) -> None:
        """A request carrying ``key`` left the running batch (finished, aborted or preempted)."""
        count = self.active.get(key, 0) - 1
        if count > 0:
            self.active[key] = count
            return
        self.active.pop(key, None)
        if not self._registered(key) and key not in self.refs:
            self._drop_weights(key)
        else:
            self._evict_idle()

    def _registered(self, key: str) -> bool:
        return any(info.key == key for info in self.registered.values())

    def _reload(self, info: AdapterInfo) -> None:
        now, weights = load_adapter(info.path, info.name, self.model, self.config.max_lora_rank, self.dtype)
        self._check_unchanged(info, now.content_hash)
        self._install(info.key, weights)
        self._evict_idle()

    @staticmethod
    def _check_unchanged(info: AdapterInfo, digest: str) -> None:
        if digest != info.content_hash:
            raise ValueError(
                f"LoRA adapter {info.name!r} changed on disk since it was loaded from {info.path}: "
                "unload and load it again to serve the new weights."
            )

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
        idle = [k for k in self.loaded if not self.active.get(k)]  # least recently used first
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
        must be active (loaded)."""
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
