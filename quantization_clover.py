"""bitsandbytes quantization of the fused 3D experts, which `from_pretrained(quantization_config=...)` leaves alone.

transformers' bitsandbytes integration converts only `nn.Linear` modules. Clover's routed experts are two fused 3D
parameters per layer (`gate_up_proj` (experts, 2 * inter, hidden) and `down_proj` (experts, hidden, inter)), about
93% of the 35B weights, so a 4-bit load silently keeps them in 16-bit. `quantize_experts` quantizes them after
loading, in place, with a parametrization: the tensor is stored quantized and dequantized (whole, once per forward
of the experts module) when the forward reads it.

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.bfloat16))
    quantize_experts(model, "nf4")

nf4/fp4 use `bitsandbytes.nn.parametrize.replace_parameter_4bit` (blockwise absmax, blocksize 64). bitsandbytes has
no 8-bit counterpart for plain parameters, so "int8" is done here in torch with the LLM.int8 weight format: row-wise
absmax, one fp32 scale per expert row, no outlier columns (it needs no bitsandbytes). A quantized model is for inference:
save the 16-bit checkpoint and quantize after loading.
"""

from __future__ import annotations

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
QUANT_TYPES = ("nf4", "fp4", "int8")


def fused_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module holding fused 3D `gate_up_proj` and `down_proj` (CloverExperts, from the package or from a
    checkpoint's remote code, and transformers' own MoE experts alike)."""
    found = []
    for name, module in model.named_modules():
        tensors = [getattr(module, p, None) for p in EXPERT_PARAMETERS]
        if all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in tensors):
            found.append((name, module))
    return found


def quantize_experts(
    model: nn.Module, quant_type: str = "nf4", blocksize: int | None = None, compress_statistics: bool = False
) -> int:
    """Quantizes `gate_up_proj` and `down_proj` of every fused-experts module of `model` in place.

    Args:
        quant_type: "nf4" or "fp4" (4-bit, bitsandbytes' blockwise format) or "int8" (row-wise absmax).
        blocksize: values per absmax for 4-bit (bitsandbytes' default, 64, when None).
        compress_statistics: 4-bit double quantization of the absmax values (`bnb_4bit_use_double_quant`).
    Returns: the number of tensors quantized (already quantized ones are left as they are).
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type ({quant_type!r}) must be one of {list(QUANT_TYPES)}.")
    if quant_type != "int8":
        try:
            from bitsandbytes.nn.parametrize import replace_parameter_4bit
        except ImportError as error:
            raise ImportError(f"{quant_type} needs bitsandbytes: pip install 'bitsandbytes>=0.48'.") from error
    modules = fused_expert_modules(model)
    if not modules:
        raise ValueError("The model has no fused experts (modules with 3D gate_up_proj and down_proj) to quantize.")

    count = 0
    for module_name, module in modules:
        for name in EXPERT_PARAMETERS:
            if parametrize.is_parametrized(module, name):
                continue
            weight = getattr(module, name)
            if weight.device.type == "meta":
                raise ValueError(
                    f"{module_name}.{name} is offloaded (on the meta device): quantize before offloading, or load "
                    "without cpu/disk entries in device_map."
                )
            if quant_type == "int8":
                _replace_parameter_int8(module, name)
            else:
                replace_parameter_4bit(
                    module, name, quant_type=quant_type, blocksize=blocksize, compress_statistics=compress_statistics
                )
            count += 1
    return count


class CloverInt8Dequantize(nn.Module):
    """Parametrization of an int8 tensor (experts, rows, columns) with one fp32 absmax per row:
    value = int8 * absmax / 127."""

    is_clover_int8_parametrization = True  # lets memory_clover.measured_weight_bytes find the scales

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("scale", scale)  # (experts, rows) fp32
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, quantized: torch.Tensor) -> torch.Tensor:
        # One expert at a time in fp32: a whole-tensor fp32 temporary would be 4 bytes per weight of the layer.
        output = torch.empty(quantized.shape, dtype=self.dtype, device=quantized.device)
        for expert in range(quantized.shape[0]):
            output[expert] = (quantized[expert].float() * (self.scale[expert, :, None] / 127)).to(self.dtype)
        return output


def _replace_parameter_int8(module: nn.Module, name: str) -> None:
    weight = getattr(module, name).data  # (experts, rows, columns)
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[:-1], dtype=torch.float32, device=weight.device)
    for expert in range(weight.shape[0]):  # one expert at a time: no fp32 copy of the whole tensor
        rows = weight[expert].float()
        # An all-zero row keeps scale 0 and quantizes to zeros (a clamped divisor avoids 0/0).
        scale[expert] = rows.abs().amax(dim=-1)
        quantized[expert] = torch.round(rows * (127.0 / scale[expert].clamp(min=1e-30))[:, None]).to(torch.int8)
    setattr(module, name, nn.Parameter(quantized, requires_grad=False))
    parametrize.register_parametrization(module, name, CloverInt8Dequantize(scale, weight.dtype), unsafe=True)
    if not getattr(module, "_clover_dequantize_cache_hooks", False):
        module.register_forward_pre_hook(_enable_dequantize_cache)
        module.register_forward_hook(_disable_dequantize_cache, always_call=True)
        module._clover_dequantize_cache_hooks = True


# The experts' forward reads each tensor once per chosen expert: without torch's parametrization cache every read
# would dequantize the whole tensor again. The cache lives for one forward of the module (as bitsandbytes does).
def _enable_dequantize_cache(module: nn.Module, inputs) -> None:
    parametrize._cache_enabled += 1


def _disable_dequantize_cache(module: nn.Module, inputs, output) -> None:
    parametrize._cache_enabled = max(0, parametrize._cache_enabled - 1)
    if not parametrize._cache_enabled:
        parametrize._cache = {}


__all__ = ["CloverInt8Dequantize", "fused_expert_modules", "quantize_experts"]
