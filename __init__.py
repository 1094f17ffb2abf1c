"""Clover: block-diffusion decoding for the Qwen3.5-MoE architecture, native to Hugging Face Transformers."""

from .configuration_clover import CloverConfig
from .generation_clover import CloverGenerationConfig, CloverGenerationMixin, CloverGenerationOutput
from .modeling_clover import CloverCache, CloverForBlockDiffusion, CloverModel, CloverPreTrainedModel

__all__ = [
    "CloverCache",
    "CloverConfig",
    "CloverForBlockDiffusion",
    "CloverGenerationConfig",
    "CloverGenerationMixin",
    "CloverGenerationOutput",
    "CloverModel",
    "CloverPreTrainedModel",
]
