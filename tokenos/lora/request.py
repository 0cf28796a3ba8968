"""`LoRARequest`: how the offline API names an adapter (vLLM's shape). Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) under a name.

    ``lora_int_id`` is vLLM's numeric handle, kept for compatibility: tokenos identifies an adapter by
    its name and the content hash of its files, so two names for one folder are two adapters."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be the adapter's folder.")
