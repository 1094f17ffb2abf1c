"""Clover: block-diffusion decoding for the Qwen3.5-MoE architecture, native to Hugging Face Transformers."""

# The checkout is the package. pytest imports this file on its own, with no parent package, when the checkout's
# folder name is not an identifier (e.g. clover-main); there is nothing to import then.
if __package__:
    from .configuration_clover import CloverConfig
    from .generation_clover import CloverGenerationConfig, CloverGenerationMixin, CloverGenerationOutput
    from .modeling_clover import CloverCache, CloverForBlockDiffusion, CloverModel, CloverPreTrainedModel


def __getattr__(name: str):
    if name == "CloverSFTTrainer":  # needs TRL (the "trl" extra): imported only when asked for
        from .trl_clover import CloverSFTTrainer

        return CloverSFTTrainer
    # Need llama-cpp-python and gguf (the "llama" extra); not in __all__, so `import *` works without them.
    if name in ("LlamaCppClover", "export_gguf"):
        from .gguf_clover import export_gguf
        from .llama_cpp_clover import LlamaCppClover

        return {"LlamaCppClover": LlamaCppClover, "export_gguf": export_gguf}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CloverCache",
    "CloverConfig",
    "CloverForBlockDiffusion",
    "CloverGenerationConfig",
    "CloverGenerationMixin",
    "CloverGenerationOutput",
    "CloverModel",
    "CloverPreTrainedModel",
    "CloverSFTTrainer",
]
