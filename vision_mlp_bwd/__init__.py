"""Fused Pallas GPU kernels for the backward pass of a vision-transformer MLP."""

from vision_mlp_bwd import backends, reference
from vision_mlp_bwd.api import mlp_backward, vision_mlp
from vision_mlp_bwd.precision import DotMode

__all__ = ["DotMode", "backends", "mlp_backward", "reference", "vision_mlp"]
__version__ = "0.1.0"
