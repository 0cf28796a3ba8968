"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch (see `manager`)."""

from tokenos.lora.request import LoRARequest

__all__ = ["LoRARequest"]
