"""Configuration of Clover, a block-diffusion language model on the Qwen3.5-MoE text architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PretrainedConfig

if TYPE_CHECKING:
    import torch

LAYER_TYPES = ("linear_attention", "full_attention")


class CloverConfig(PretrainedConfig):
    r"""
    Configuration of [`CloverForBlockDiffusion`]. The defaults describe Clover-35B-A3B.

    The architecture fields are those of transformers' `Qwen3_5MoeTextConfig` (same names, same meaning), so a
    Qwen3.5-MoE text config converts field for field. Clover adds the two fields of block diffusion:

    Args:
        block_size (`int`, defaults to 32):
            Number of tokens decoded together: a block starts as `block_size` mask tokens and is denoised until no
            mask is left.
        mask_token_id (`int`, defaults to 248077):
            Id of `<|mask|>`, the token a not-yet-decoded position holds. Must lie inside the vocabulary.
        layer_types (`list[str]`, *optional*):
            `"linear_attention"` (Gated DeltaNet) or `"full_attention"` per layer. Defaults to three linear layers
            followed by one full-attention layer, repeated (`full_attention_interval=4`).
        causal_loss_weight (`float`, defaults to 0.0):
            Training only: the weight of a next-token loss on the clean sequence (a causal forward, as in the
            autoregressive base) added to the block-diffusion loss. It keeps a converted base's causal ability,
            which self-speculative decoding verifies with.
        causal_distill_weight (`float`, defaults to 0.0):
            Training only: the weight of a distillation term that pulls each masked answer token's block-diffusion
            prediction towards the causal path's next-token distribution at the same position (KL divergence,
            the causal side detached), weighted like the block-diffusion loss. 0 turns it off.
        experts_quantization (`dict`, *optional*):
            How the routed experts are stored, written by quantization (see `quantization_clover`) and read back by
            `from_pretrained`: `{"quant_type": "nf4" | "fp4" | "int8", "blocksize": int, "double_quant": bool}`.
            None (the default) stores them in 16-bit, as the release does.
        rope_parameters (`dict`, *optional*):
            `{"rope_type": "default", "rope_theta": ..., "partial_rotary_factor": ...}`; only the default RoPE is
            supported (the text positions of Qwen3.5's mRoPE are plain RoPE).
    """

    model_type = "clover"
    keys_to_ignore_at_inference = ["past_key_values"]

    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
        "layers.*.linear_attn.in_proj_qkv": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_z": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_b": "colwise_gather_output",
        "layers.*.linear_attn.in_proj_a": "colwise_gather_output",
        "layers.*.linear_attn.out_proj": "colwise_gather_output",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(
        self,
        vocab_size: int = 248320,
        hidden_size: int = 2048,
        num_hidden_layers: int = 40,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 2,
        head_dim: int = 256,
        hidden_act: str = "silu",
        max_position_embeddings: int = 131072,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        linear_conv_kernel_dim: int = 4,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_num_key_heads: int = 16,
        linear_num_value_heads: int = 32,
        moe_intermediate_size: int = 512,
        shared_expert_intermediate_size: int = 512,
        num_experts_per_tok: int = 8,
        num_experts: int = 256,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
        causal_loss_weight: float = 0.0,
        causal_distill_weight: float = 0.0,
        layer_types: list[str] | None = None,
        full_attention_interval: int = 4,
        block_size: int = 32,
        mask_token_id: int = 248077,
        pad_token_id: int | None = 248044,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = 248046,
        experts_quantization: dict | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        self.causal_loss_weight = causal_loss_weight
        self.causal_distill_weight = causal_distill_weight
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.experts_quantization = experts_quantization

        # Qwen3.5 checkpoints spell the partial rotary factor and theta at the top level or inside rope_parameters.
        rope_parameters = dict(rope_parameters or {})
        rope_parameters.setdefault("rope_type", kwargs.pop("rope_type", "default"))
        rope_parameters.setdefault("rope_theta", kwargs.pop("rope_theta", 10_000_000.0))
        rope_parameters.setdefault("partial_rotary_factor", kwargs.pop("partial_rotary_factor", 0.25))
        self.rope_parameters = rope_parameters

        if layer_types is None:
            layer_types = [
                "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                for i in range(num_hidden_layers)
            ]
        self.layer_types = list(layer_types)

        self.validate_clover()  # before the base class, whose own layer_types check raises a less helpful error
        kwargs.setdefault("auto_map", _AUTO_MAP)
        kwargs.setdefault("architectures", ["CloverForBlockDiffusion"])
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def validate_clover(self) -> None:
        """Checks the fields that would otherwise fail deep inside a forward, or silently decode garbage."""
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer.")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}: "
                "give one type per layer, or leave layer_types unset for the default pattern."
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types contains {unknown}; each entry must be one of {list(LAYER_TYPES)}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})."
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
                f"({self.linear_num_key_heads})."
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed num_experts ({self.num_experts})."
            )
        for name in ("causal_loss_weight", "causal_distill_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} ({value!r}) must be a number >= 0 (0 turns it off).")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size ({self.block_size!r}) must be a positive integer, e.g. 32.")
        if self.block_size > self.max_position_embeddings:
            raise ValueError(
                f"block_size ({self.block_size}) cannot exceed max_position_embeddings ({self.max_position_embeddings})."
            )
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id ({self.mask_token_id!r}) must be a token id inside the vocabulary [0, {self.vocab_size}); "
                "add <|mask|> to the tokenizer and set mask_token_id to its id."
            )
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type ({rope_type!r}) is not supported; use 'default'.")
        factor = self.rope_parameters["partial_rotary_factor"]
        rotary_dim = int(self.head_dim * factor)
        if not 0 < factor <= 1 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor ({factor}) must be in (0, 1] and give an even rotary dimension "
                f"(head_dim {self.head_dim} * {factor} = {self.head_dim * factor})."
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters["partial_rotary_factor"])


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """A ValueError for ids outside [0, vocab_size), which would index garbage or crash the device (a host sync).
    Here, beside the vocabulary it checks against, so that the model's embedding and `generate` share it."""
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(
            f"input_ids contain ids outside the vocabulary [0, {vocab_size}) (min {int(input_ids.min())}, max "
            f"{int(input_ids.max())}): was the text encoded with another tokenizer?"
        )


_AUTO_MAP = {
    "AutoConfig": "configuration_clover.CloverConfig",
    "AutoModel": "modeling_clover.CloverModel",
    "AutoModelForCausalLM": "modeling_clover.CloverForBlockDiffusion",
}


CloverConfig._auto_class = "AutoConfig"
