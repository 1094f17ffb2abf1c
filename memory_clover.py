"""How much memory a Clover model needs, from its config alone: weights per dtype and bitsandbytes quantization,
and the cache per sequence (attention keys/values, Gated DeltaNet state, conv window).

Everything is counted tensor by tensor with the shapes `modeling_clover` creates, so the 35B checkpoint can be sized
before it is downloaded, and the tests check the arithmetic against a real tiny model to the byte.

Quantization assumptions (bitsandbytes 0.50, through `BitsAndBytesConfig` + `quantize_experts`):
* quantized: the `nn.Linear` layers of the decoder layers (attention q/k/v/o, GDN in_proj_qkv/in_proj_z/out_proj,
  shared expert gate/up/down), which `from_pretrained(quantization_config=...)` converts, and the fused 3D experts
  (`gate_up_proj`, `down_proj`), which Clover quantizes itself;
* kept in the 16-bit dtype: embeddings, `lm_head` (transformers' default skip), the gates Clover always leaves
  16-bit (`shared_expert_gate`, GDN `in_proj_a`/`in_proj_b`; `quantization_clover.UNQUANTIZED_MODULES`), the
  norms, the router (a plain parameter, not an `nn.Linear`), the depthwise conv, `A_log` and `dt_bias`;
* nf4: two values per byte + one fp32 absmax per `blocksize` (64) values + the 16-entry fp32 code, per tensor
  (double quantization: uint8 absmax + fp32 absmax per 256 of them + a 256-entry code + an fp32 offset);
* int8 (LLM.int8): one byte per value + one fp32 scale per output row (for the experts: per expert row).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .configuration_clover import CloverConfig
from .quantization_clover import DEFAULT_SKIPPED, UNQUANTIZED_MODULES

QUANTIZATIONS = ("none", "int8", "nf4")
NF4_CODE_ENTRIES = 16  # the nf4 lookup table bitsandbytes stores with every quantized tensor (fp32)
NESTED_BLOCKSIZE = 256  # double quantization: one fp32 absmax per 256 uint8 absmax values
NESTED_CODE_ENTRIES = 256  # and the 8-bit dynamic code (fp32) of that second level
GIB = 2**30

# Usable memory of common cards (what torch.cuda.mem_get_info reports on an idle device, GiB).
GPUS = (
    ("16 GB (RTX 4080 / 5070 Ti)", 15.6),
    ("24 GB (RTX 4090 / L4)", 23.6),
    ("48 GB (L40S / RTX 6000 Ada)", 44.4),
    ("80 GB (A100 / H100)", 79.2),
    ("141 GB (H200)", 139.8),
)
# CUDA context, allocator slack and the activations of a denoising step (logits of a block, one layer's temporaries).
RUNTIME_RESERVE_GIB = 2.0


# --------------------------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CloverTensorSpec:
    """One parameter tensor of a Clover model, named as `model.named_parameters()` names it.

    `group` sorts the weights for the table; `quantizable` says who quantizes the tensor: "linear" (bitsandbytes'
    `from_pretrained` conversion of `nn.Linear`), "experts" (`quantize_experts`), or None (stays 16-bit).
    """

    name: str
    shape: tuple[int, ...]
    group: str
    quantizable: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module_name(self) -> str:
        return self.name.rpartition(".")[0]


def parameter_specs(config: CloverConfig) -> list[CloverTensorSpec]:
    """Every parameter of `CloverForBlockDiffusion(config)`, in `named_parameters()` order, from the config alone."""
    c = config
    hidden = c.hidden_size
    specs = [CloverTensorSpec("model.embed_tokens.weight", (c.vocab_size, hidden), "embeddings")]
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    for i, layer_type in enumerate(c.layer_types):
        p = f"model.layers.{i}."

        def linear(name, in_features, out_features, group, bias=False, prefix=p):
            weight = [CloverTensorSpec(f"{prefix}{name}.weight", (out_features, in_features), group, "linear")]
            return weight + ([CloverTensorSpec(f"{prefix}{name}.bias", (out_features,), group)] if bias else [])

        if layer_type == "linear_attention":
            a = p + "linear_attn."
            specs += [
                CloverTensorSpec(a + "dt_bias", (c.linear_num_value_heads,), "linear_attn"),
                CloverTensorSpec(a + "A_log", (c.linear_num_value_heads,), "linear_attn"),
                CloverTensorSpec(a + "conv1d.weight", (conv_dim, 1, c.linear_conv_kernel_dim), "linear_attn"),
                CloverTensorSpec(a + "norm.weight", (c.linear_value_head_dim,), "norms"),
                *linear("linear_attn.out_proj", value_dim, hidden, "linear_attn"),
                *linear("linear_attn.in_proj_qkv", hidden, conv_dim, "linear_attn"),
                *linear("linear_attn.in_proj_z", hidden, value_dim, "linear_attn"),
                *linear("linear_attn.in_proj_b", hidden, c.linear_num_value_heads, "linear_attn"),
                *linear("linear_attn.in_proj_a", hidden, c.linear_num_value_heads, "linear_attn"),
            ]
        else:
            bias, heads = c.attention_bias, c.num_attention_heads * c.head_dim
            kv = c.num_key_value_heads * c.head_dim
            specs += [
                *linear("self_attn.q_proj", hidden, 2 * heads, "self_attn", bias),  # query and output gate
                *linear("self_attn.k_proj", hidden, kv, "self_attn", bias),
                *linear("self_attn.v_proj", hidden, kv, "self_attn", bias),
                *linear("self_attn.o_proj", heads, hidden, "self_attn", bias),
                CloverTensorSpec(p + "self_attn.q_norm.weight", (c.head_dim,), "norms"),
                CloverTensorSpec(p + "self_attn.k_norm.weight", (c.head_dim,), "norms"),
            ]
        m, shared = p + "mlp.", c.shared_expert_intermediate_size
        experts, inter = c.num_experts, c.moe_intermediate_size
        specs += [
            CloverTensorSpec(m + "gate.weight", (experts, hidden), "router"),
            CloverTensorSpec(m + "experts.gate_up_proj", (experts, 2 * inter, hidden), "experts", "experts"),
            CloverTensorSpec(m + "experts.down_proj", (experts, hidden, inter), "experts", "experts"),
            *linear("mlp.shared_expert.gate_proj", hidden, shared, "shared_expert"),
            *linear("mlp.shared_expert.up_proj", hidden, shared, "shared_expert"),
            *linear("mlp.shared_expert.down_proj", shared, hidden, "shared_expert"),
            *linear("mlp.shared_expert_gate", hidden, 1, "shared_expert"),
            CloverTensorSpec(p + "input_layernorm.weight", (hidden,), "norms"),
            CloverTensorSpec(p + "post_attention_layernorm.weight", (hidden,), "norms"),
        ]
    specs.append(CloverTensorSpec("model.norm.weight", (hidden,), "norms"))
    if not c.tie_word_embeddings:  # tied, lm_head is the embedding matrix and is counted once
        specs.append(CloverTensorSpec("lm_head.weight", (c.vocab_size, hidden), "lm_head", "linear"))
    return specs


def is_skipped(module_name: str, skip_modules: Iterable[str]) -> bool:
    """A skip pattern names a module or a dotted suffix of it (`lm_head`, `shared_expert_gate`), as in
    `BitsAndBytesConfig(llm_int8_skip_modules=...)`."""
    return any(module_name == key or module_name.endswith("." + key) for key in skip_modules)


def tensor_bytes(
    spec: CloverTensorSpec,
    dtype: torch.dtype = torch.bfloat16,
    quantization: str = "none",
    skip_modules: Iterable[str] = DEFAULT_SKIPPED,
    quantize_experts: bool = True,
    blocksize: int = 64,
    double_quant: bool = False,
) -> int:
    """Bytes one tensor takes once loaded (and quantized): data plus bitsandbytes' statistics."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization ({quantization!r}) must be one of {list(QUANTIZATIONS)}.")
    skip_modules = [*skip_modules, *UNQUANTIZED_MODULES]  # from_pretrained adds these to any bitsandbytes config
    quantized = quantization != "none" and (
        (spec.quantizable == "linear" and not is_skipped(spec.module_name, skip_modules))
        or (spec.quantizable == "experts" and quantize_experts)
    )
    n = spec.numel
    if not quantized:
        return n * dtype.itemsize
    if quantization == "int8":
        rows = n // spec.shape[-1]
        return n + 4 * rows  # int8 values + fp32 absmax scale per row
    blocks = math.ceil(n / blocksize)
    if double_quant:  # uint8 absmax, their fp32 absmax per 256, the 8-bit code and an fp32 offset
        absmax = blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 4 * NESTED_CODE_ENTRIES + 4
    else:
        absmax = 4 * blocks
    return math.ceil(n / 2) + absmax + 4 * NF4_CODE_ENTRIES


def weight_bytes(
    config: CloverConfig, dtype: torch.dtype = torch.bfloat16, quantization: str = "none", **options
) -> dict[str, int]:
    """Bytes of the weights per group ("embeddings", "linear_attn", "self_attn", "router", "experts",
    "shared_expert", "norms", "lm_head"). `options` go to `tensor_bytes` (skip_modules, quantize_experts, ...)."""
    totals: dict[str, int] = {}
    for spec in parameter_specs(config):
        totals[spec.group] = totals.get(spec.group, 0) + tensor_bytes(spec, dtype, quantization, **options)
    return totals


def parameter_counts(config: CloverConfig) -> dict[str, int]:
    """Number of parameters per group (same groups as `weight_bytes`)."""
    counts: dict[str, int] = {}
    for spec in parameter_specs(config):
        counts[spec.group] = counts.get(spec.group, 0) + spec.numel
    return counts


def active_parameters(config: CloverConfig) -> int:
    """Parameters one token uses: everything but the experts it was not routed to (embeddings and lm_head count)."""
    counts = parameter_counts(config)
    routed = counts["experts"] * config.num_experts_per_tok // config.num_experts
    return sum(counts.values()) - counts["experts"] + routed


# --------------------------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CloverCacheBytes:
    """Bytes of a `CloverCache`: attention keys+values grow per token, GDN state and conv window are fixed per sequence."""

    attention_per_token: int  # full-attention layers x 2 (k, v) x kv_heads x head_dim x dtype bytes
    recurrent_per_sequence: int  # linear layers x v_heads x k_dim x v_dim x state dtype bytes (fp32)
    conv_per_sequence: int  # linear layers x conv_dim x (kernel - 1) x dtype bytes

    def total(self, num_tokens: int, batch_size: int = 1) -> int:
        per_sequence = self.attention_per_token * num_tokens + self.recurrent_per_sequence + self.conv_per_sequence
        return batch_size * per_sequence


def cache_bytes(
    config: CloverConfig, dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32
) -> CloverCacheBytes:
    """The committed cache per token and per sequence. Keys, values and the conv window are in the activation dtype;
    the recurrent state is fp32 (the torch path and the fla kernels both keep it in fp32: it accumulates decays).
    `CloverCache` allocates its key/value buffers for the prompt + max_new_tokens up front in `generate` (else they
    grow by doubling, so up to 2x the committed bytes)."""
    c = config
    num_full = sum(t == "full_attention" for t in c.layer_types)
    num_linear = len(c.layer_types) - num_full
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim  # one (k_dim, v_dim) per head
    return CloverCacheBytes(
        attention_per_token=num_full * 2 * c.num_key_value_heads * c.head_dim * dtype.itemsize,
        recurrent_per_sequence=num_linear * state * state_dtype.itemsize,
        conv_per_sequence=num_linear * conv_dim * (c.linear_conv_kernel_dim - 1) * dtype.itemsize,
    )


# --------------------------------------------------------------------------------------------------------------------
# Estimate and report
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class CloverMemoryEstimate:
    """Weights and cache of one configuration at a context length and batch size (bytes)."""

    dtype: torch.dtype
    quantization: str
    context: int
    batch_size: int
    parameters: dict[str, int]
    weights: dict[str, int]
    cache: CloverCacheBytes
    active_parameters: int
    prefill_mask: int = 0  # the dense (batch, 1, L, L) bool mask of a one-forward prefill

    @property
    def weight_total(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_total(self) -> int:
        return self.cache.total(self.context, self.batch_size)

    @property
    def total(self) -> int:
        return self.weight_total + self.cache_total

    def fitting_gpus(self) -> list[str]:
        need = self.total / GIB + RUNTIME_RESERVE_GIB
        return [name for name, usable in GPUS if need <= usable]


def estimate_memory(
    config: CloverConfig,
    context: int | None = None,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    quantization: str = "none",
    **options,
) -> CloverMemoryEstimate:
    """Weights (see `weight_bytes` for `options`) plus the cache of `batch_size` sequences of `context` tokens
    (default: the model's full context, `max_position_embeddings`)."""
    context = config.max_position_embeddings if context is None else context
    if context < 1 or batch_size < 1:
        raise ValueError(f"context ({context}) and batch_size ({batch_size}) must be positive.")
    return CloverMemoryEstimate(
        dtype=dtype,
        quantization=quantization,
        context=context,
        batch_size=batch_size,
        parameters=parameter_counts(config),
        weights=weight_bytes(config, dtype, quantization, **options),
        cache=cache_bytes(config, dtype),
        active_parameters=active_parameters(config),
        prefill_mask=batch_size * context * context,
    )


def format_estimate(estimate: CloverMemoryEstimate) -> str:
    """The table `scripts/memory.py` prints: weights per group, cache, totals and the cards it fits."""
    e = estimate
    dtype_name = str(e.dtype).removeprefix("torch.")
    lines = [
        f"weights ({dtype_name}, quantization {e.quantization})",
        f"  {'group':<16}{'parameters':>16}{'GiB':>10}{'share':>8}",
    ]
    total_params = sum(e.parameters.values())
    for group, count in sorted(e.parameters.items(), key=lambda item: -item[1]):
        size = e.weights[group]
        lines.append(f"  {group:<16}{count:>16,}{size / GIB:>10.2f}{size / e.weight_total:>8.1%}")
    lines += [
        f"  {'total':<16}{total_params:>16,}{e.weight_total / GIB:>10.2f}   ({e.weight_total / 1e9:.1f} GB; "
        f"{e.active_parameters / 1e9:.2f}B active per token)",
        "cache per sequence",
        f"  attention keys/values   {e.cache.attention_per_token:>12,} B per token",
        f"  GDN recurrent state     {e.cache.recurrent_per_sequence:>12,} B (fp32)",
        f"  GDN conv window         {e.cache.conv_per_sequence:>12,} B",
        f"  at {e.context:,} tokens      {e.cache.total(e.context) / GIB:>12.2f} GiB",
        f"total at context {e.context:,} x batch {e.batch_size}: {e.weight_total / GIB:.2f} GiB weights + "
        f"{e.cache_total / GIB:.2f} GiB cache = {e.total / GIB:.2f} GiB (+{RUNTIME_RESERVE_GIB:.0f} GiB runtime reserve)",
    ]
    fits = ", ".join(e.fitting_gpus()) or "no single card listed; shard with device_map or quantize"
    lines.append(f"fits on: {fits}")
    lines.append(
        f"note: a prompt prefilled in one forward also builds a dense (batch, 1, L, L) bool mask: "
        f"{e.prefill_mask / GIB:.2f} GiB at L = {e.context:,}; prefill long prompts in chunks."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Measurement (what the tests compare the arithmetic with)
# --------------------------------------------------------------------------------------------------------------------


def measured_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: every parameter (tied ones once) plus the bitsandbytes statistics that live
    beside the data (Params4bit / parametrization quant states, Int8Params row scales, our int8 expert scales)."""
    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()

    def add_quant_state(state) -> None:
        if state is None:
            return
        for name in ("absmax", "code", "offset"):
            add(getattr(state, name, None))
        add_quant_state(getattr(state, "state2", None))

    for parameter in model.parameters():
        add(parameter)
        add_quant_state(getattr(parameter, "quant_state", None))
        add(getattr(parameter, "SCB", None))
    for module in model.modules():
        add_quant_state(getattr(module, "quant_state", None))  # bitsandbytes' Bnb4bitParametrization
        if getattr(module, "is_clover_quantization", False):  # quantization_clover's expert statistics
            for buffer in module.buffers(recurse=False):
                add(buffer)
    return total


def measured_cache_bytes(cache) -> int:
    """Bytes of the committed tensors of a `CloverCache` (`cache.tensors()`)."""
    return sum(t.numel() * t.element_size() for t in cache.tensors())


__all__ = [
    "GPUS",
    "QUANTIZATIONS",
    "CloverCacheBytes",
    "CloverMemoryEstimate",
    "CloverTensorSpec",
    "active_parameters",
    "cache_bytes",
    "estimate_memory",
    "format_estimate",
    "measured_cache_bytes",
    "measured_weight_bytes",
    "parameter_counts",
    "parameter_specs",
    "tensor_bytes",
    "weight_bytes",
]
