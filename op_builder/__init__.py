"""Op builders of ds_comet (DeepSpeed CUDAOpBuilder subclasses)."""

from .comet import CometBuilder

__all__ = ["CometBuilder"]
