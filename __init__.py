"""Clover: block-diffusion decoding for the Qwen3.5-MoE architecture, native to Hugging Face Transformers."""

# The checkout is the package. pytest imports this file on its own, with no parent package, when the checkout's
# folder name is not an identifier (e.g. clover-main); there is nothing to import then.
if __package__:
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
