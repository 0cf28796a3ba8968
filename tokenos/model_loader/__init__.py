"""Weight loading: checkpoint files -> (HF name, tensor) streams -> each parameter's own weight_loader."""

from tokenos.model_loader.loader import iter_checkpoint_weights, load_weights

__all__ = ["iter_checkpoint_weights", "load_weights"]
