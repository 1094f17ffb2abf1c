"""Quantization of the fused 3D experts, which transformers' bitsandbytes integration leaves alone.

transformers converts only `nn.Linear` modules to bitsandbytes layers. Clover's routed experts are two fused 3D
parameters per layer (`gate_up_proj` (experts, 2 * inter, hidden) and `down_proj` (experts, hidden, inter)), about
93% of the 35B weights. Clover quantizes them itself, with a parametrization: the tensor is stored quantized and
dequantized (whole, once per forward of the experts module) when the forward reads it.

- **At load time**: `from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True))` (nf4 or fp4,
  `bnb_4bit_use_double_quant` honoured) or `load_in_8bit=True` quantizes each expert tensor as the loader assigns
  it (`CloverExperts.__setattr__`), so the 16-bit experts of one layer at most are in memory at once. Put
  "experts" in `llm_int8_skip_modules` to keep them 16-bit.
- **After loading**: `quantize_experts(model, "nf4")` does the same to a model already in memory.
- **Pre-quantized checkpoints**: `save_pretrained` of a model with quantized experts writes them quantized (the
  packed data and its statistics as tensors, `config.experts_quantization` saying the format);
  `from_pretrained` builds the experts in that format and loads them as they are, without re-quantizing.

4-bit is bitsandbytes' blockwise format (absmax per block of 64 by default, optionally double-quantized statistics;
`bitsandbytes.functional.quantize_4bit` / `dequantize_4bit`). bitsandbytes has no 8-bit counterpart for plain
parameters, so "int8" is done here in torch with the LLM.int8 weight format: row-wise absmax, one fp32 scale per
expert row, no outlier columns (it needs no bitsandbytes). A quantized model is for inference and for adapters on
its other layers (QLoRA); the experts' quantized storage is frozen.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
QUANT_TYPES = ("nf4", "fp4", "int8")
# The fp32 statistics of quantized experts, as a pattern on their state-dict keys: from_pretrained(dtype=bf16) must
# not round them (`_keep_in_fp32_modules_strict`), nor touch the uint8/int8 data beside them.
FP32_STATISTICS = r"experts\.parametrizations\.\w+\.0\.(absmax|quant_map|nested_absmax|nested_quant_map|offset|scale)$"
DEFAULT_BLOCKSIZE = 64  # bitsandbytes' 4-bit default
NESTED_BLOCKSIZE = 256  # bitsandbytes' blocks of the double-quantized statistics
# Linear layers a bitsandbytes config never quantizes (matched as name suffixes): the MoE router, the shared
# expert's gate and the Gated DeltaNet's decay / write-strength projections. See `with_unquantized_gates`.
UNQUANTIZED_MODULES = ("mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b")
DEFAULT_SKIPPED = ("lm_head",)  # what transformers skips when the config names nothing


def experts_spec(quant_type: str, blocksize: int | None = None, double_quant: bool = False) -> dict:
    """The experts' storage format, as `config.experts_quantization` records it."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type ({quant_type!r}) must be one of {list(QUANT_TYPES)}.")
    if quant_type == "int8":
        return {"quant_type": "int8", "blocksize": None, "double_quant": False}
    blocksize = blocksize or DEFAULT_BLOCKSIZE
    if blocksize <= 0 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize ({blocksize}) must be a power of two, e.g. {DEFAULT_BLOCKSIZE}.")
    return {"quant_type": quant_type, "blocksize": blocksize, "double_quant": bool(double_quant)}


def load_time_spec(config) -> dict | None:
    """What a bitsandbytes `quantization_config` passed to `from_pretrained` asks of the experts (None: 16-bit):
    4-bit in its `bnb_4bit_quant_type` (double quant as `bnb_4bit_use_double_quant`), 8-bit as "int8"; none when
    `llm_int8_skip_modules` names the experts."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None or getattr(config, "experts_quantization", None):
        return None
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    if quantization.get("quant_method") != "bitsandbytes":
        return None
    skipped = quantization.get("llm_int8_skip_modules") or []
    if any(name == "experts" or name.endswith(".experts") for name in skipped):
        return None
    if quantization.get("load_in_4bit"):
        return experts_spec(
            quantization.get("bnb_4bit_quant_type", "nf4"), double_quant=quantization.get("bnb_4bit_use_double_quant")
        )
    if quantization.get("load_in_8bit"):
        return experts_spec("int8")
    return None


def with_unquantized_gates(quantization_config):
    """A copy of a bitsandbytes `quantization_config` (object or dict) whose `llm_int8_skip_modules` also names the
    routers and gates (`UNQUANTIZED_MODULES`); any other quantization config is returned as it is.

    The gates are tiny (one output for `shared_expert_gate`, one per value head for `in_proj_a`/`in_proj_b`), so
    quantizing them saves nothing, and they steer everything after them: Qwen's own quantized releases keep them
    16-bit. bitsandbytes' CPU 4-bit kernel also refuses them: on CPUs with AVX512-BF16 it repacks each Linear4bit
    in groups of 32 output rows and asserts at the first forward in eval mode. A list the caller gave is kept and
    extended; none given means transformers' default (`lm_head`) plus the gates."""
    if quantization_config is None:
        return None
    as_dict = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    if as_dict.get("quant_method") != "bitsandbytes":
        return quantization_config
    skipped = list(as_dict.get("llm_int8_skip_modules") or DEFAULT_SKIPPED)
    skipped += [name for name in UNQUANTIZED_MODULES if name not in skipped]
    if isinstance(quantization_config, dict):
        return {**quantization_config, "llm_int8_skip_modules": skipped}
    quantization_config = copy.deepcopy(quantization_config)
    quantization_config.llm_int8_skip_modules = skipped
    return quantization_config


def unpack_cpu_4bit_layers(model: nn.Module) -> int:
    """Returns every bitsandbytes `Linear4bit` of `model` that its CPU kernel has repacked to the storage format it
    saves in; returns how many it unpacked.

    In eval mode on CPUs with AVX512-BF16, bitsandbytes (0.49-0.50) repacks each Linear4bit at its first forward:
    the weight into 32-row tiles and the absmax, as bf16, transposed to (blocks, rows). Its own inverse, run when the
    layer is saved, restores the weight but leaves a plain (not double-quantized) absmax transposed, so a
    checkpoint saved after any generate holds scrambled statistics, and so does the live model afterwards. Here
    the absmax is put back in its saved layout as well (fp32 of the bf16 values the kernel ran with, so the reload
    computes what the live model computed). The next forward repacks as usual."""
    count = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None or not getattr(state, "packing_format_for_cpu", False):
            continue
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        module.weight.data, state = _convert_weight_packed_for_cpu_inverse(module.weight.data, state)
        if state.absmax.dim() == 2:  # the plain absmax, still (blocks, rows): back to one value per block
            state.absmax = state.absmax.T.reshape(-1).float().contiguous()
        module.weight.quant_state = state
        if getattr(module, "quant_state", None) is not None:
            module.quant_state = state
        count += 1
    return count


def fused_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module holding fused 3D `gate_up_proj` and `down_proj` (CloverExperts, from the package or from a
    checkpoint's remote code, and transformers' own MoE experts alike)."""
    found = []
    for name, module in model.named_modules():
        tensors = [getattr(module, p, None) for p in EXPERT_PARAMETERS]
        if all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in tensors):
            found.append((name, module))
    return found


def stored_spec(model: nn.Module) -> dict | None:
    """The format the model's experts are stored in now (None: 16-bit); one format for all, or an error."""
    specs = set()
    for _, module in fused_expert_modules(model):
        for name in EXPERT_PARAMETERS:
            if parametrize.is_parametrized(module, name):
                specs.add(tuple(sorted(module.parametrizations[name][0].spec().items())))
            else:
                specs.add(None)
    if len(specs) > 1:
        raise ValueError(
            "The experts are stored in more than one format (some quantized, some not): call quantize_experts(model, "
            "quant_type) to quantize the rest before saving."
        )
    spec = next(iter(specs), None)
    return dict(spec) if spec else None


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
    spec = experts_spec(quant_type, blocksize, compress_statistics)
    modules = fused_expert_modules(model)
    if not modules:
        raise ValueError("The model has no fused experts (modules with 3D gate_up_proj and down_proj) to quantize.")
    count = 0
    for module_name, module in modules:
        for name in EXPERT_PARAMETERS:
            if parametrize.is_parametrized(module, name):
                continue
            if getattr(module, name).device.type == "meta":
                raise ValueError(
                    f"{module_name}.{name} is offloaded (on the meta device): quantize before offloading, or load "
                    "without cpu/disk entries in device_map."
                )
            quantize_tensor(module, name, spec)
            count += 1
    return count


@torch.no_grad()  # the loader's tensors may require grad: no graph may keep the 16-bit tensor alive
def quantize_tensor(module: nn.Module, name: str, spec: dict) -> None:
    """Replaces the 16-bit 3D parameter `name` of `module` by its quantized storage and a dequantizing
    parametrization."""
    weight = getattr(module, name).detach()
    if spec["quant_type"] == "int8":
        stored, dequantize = CloverInt8Dequantize.quantize(weight)
    else:
        stored, dequantize = Clover4bitDequantize.quantize(weight, spec)
    _register(module, name, stored, dequantize)


def prepare_quantized_storage(module: nn.Module, spec: dict) -> None:
    """Gives `module`'s experts the (empty) quantized storage of `spec`, for a pre-quantized checkpoint to load into:
    its tensors are named like those a quantized model's `state_dict` has."""
    for name in EXPERT_PARAMETERS:
        weight = getattr(module, name)
        shape, device = tuple(weight.shape), weight.device
        if spec["quant_type"] == "int8":
            stored = torch.empty(shape, dtype=torch.int8, device=device)
            dequantize = CloverInt8Dequantize(torch.empty(shape[:-1], device=device), weight.dtype)
        else:
            stored = torch.empty(((math.prod(shape) + 1) // 2, 1), dtype=torch.uint8, device=device)
            dequantize = Clover4bitDequantize(shape, weight.dtype, spec, device=device)
        _register(module, name, stored, dequantize)


def _register(module: nn.Module, name: str, stored: torch.Tensor, dequantize: nn.Module) -> None:
    setattr(module, name, nn.Parameter(stored, requires_grad=False))
    parametrize.register_parametrization(module, name, dequantize, unsafe=True)
    if not getattr(module, "_clover_dequantize_cache_hooks", False):
        module.register_forward_pre_hook(_enable_dequantize_cache)
        module.register_forward_hook(_disable_dequantize_cache, always_call=True)
        module._clover_dequantize_cache_hooks = True


class CloverInt8Dequantize(nn.Module):
    """Parametrization of an int8 tensor (experts, rows, columns) with one fp32 absmax per row:
    value = int8 * absmax / 127."""

    is_clover_quantization = True  # lets memory_clover.measured_weight_bytes find the statistics

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("scale", scale)  # (experts, rows) fp32
        self.dtype = dtype

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, CloverInt8Dequantize]:
        quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.empty(weight.shape[:-1], dtype=torch.float32, device=weight.device)
        for expert in range(weight.shape[0]):  # one expert at a time: no fp32 copy of the whole tensor
            rows = weight[expert].float()
            # An all-zero row keeps scale 0 and quantizes to zeros (a clamped divisor avoids 0/0).
            scale[expert] = rows.abs().amax(dim=-1)
            quantized[expert] = torch.round(rows * (127.0 / scale[expert].clamp(min=1e-30))[:, None]).to(torch.int8)
        return quantized, CloverInt8Dequantize(scale, weight.dtype)

    def spec(self) -> dict:
        return experts_spec("int8")

    @torch.no_grad()
    def forward(self, quantized: torch.Tensor) -> torch.Tensor:
        # One expert at a time in fp32: a whole-tensor fp32 temporary would be 4 bytes per weight of the layer.
        output = torch.empty(quantized.shape, dtype=self.dtype, device=quantized.device)
        for expert in range(quantized.shape[0]):
            output[expert] = (quantized[expert].float() * (self.scale[expert, :, None] / 127)).to(self.dtype)
        return output


class Clover4bitDequantize(nn.Module):
    """Parametrization of a tensor packed by bitsandbytes' 4-bit blockwise quantization (two values per byte).

    Its statistics are buffers, so `state_dict` saves them and `from_pretrained` loads them back: `absmax` (fp32, one
    per block; when double-quantized `quantized_absmax` (uint8) with `nested_absmax`, `nested_quant_map` and
    `offset`) and `quant_map` (the 16 values of nf4 or fp4). `FP32_STATISTICS` names the fp32 ones."""

    is_clover_quantization = True

    def __init__(self, shape, dtype: torch.dtype, spec: dict, device=None):
        super().__init__()
        self.shape, self.dtype = torch.Size(shape), dtype
        self.quant_type, self.blocksize, self.double_quant = (
            spec["quant_type"],
            spec["blocksize"],
            spec["double_quant"],
        )
        blocks = math.ceil(math.prod(shape) / self.blocksize)
        if self.double_quant:  # the absmax values themselves 8-bit quantized, in blocks of 256
            self.register_buffer("quantized_absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
        else:
            self.register_buffer("absmax", torch.empty(blocks, device=device))
        self.register_buffer("quant_map", torch.empty(16, device=device))
        if self.double_quant:
            self.register_buffer("nested_absmax", torch.empty(math.ceil(blocks / NESTED_BLOCKSIZE), device=device))
            self.register_buffer("nested_quant_map", torch.empty(256, device=device))
            self.register_buffer("offset", torch.empty((), device=device))

    @staticmethod
    def quantize(weight: torch.Tensor, spec: dict) -> tuple[torch.Tensor, Clover4bitDequantize]:
        """bitsandbytes' `quantize_4bit` of the whole tensor, done one expert at a time: its CPU kernel makes
        temporaries many times the size of its input, and an expert's values fill whole blocks (and bytes), so the
        pieces join into exactly the whole tensor's result. Double quantization then runs on all the absmax values
        at once, as bitsandbytes does."""
        from bitsandbytes.functional import quantize_4bit, quantize_blockwise

        blocksize, quant_type = spec["blocksize"], spec["quant_type"]
        per_expert = weight[0].numel()
        pieces = weight if per_expert % blocksize == 0 and per_expert % 2 == 0 else weight[None]
        packed = torch.empty(((weight.numel() + 1) // 2, 1), dtype=torch.uint8, device=weight.device)
        absmax = torch.empty(math.ceil(weight.numel() / blocksize), device=weight.device)
        for i, piece in enumerate(pieces):
            piece_packed, state = quantize_4bit(piece, blocksize=blocksize, quant_type=quant_type)
            packed[i * len(piece_packed) : (i + 1) * len(piece_packed)] = piece_packed
            absmax[i * len(state.absmax) : (i + 1) * len(state.absmax)] = state.absmax
        dequantize = Clover4bitDequantize(weight.shape, weight.dtype, spec, device=weight.device)
        dequantize.quant_map.copy_(state.code)
        if not spec["double_quant"]:
            dequantize.absmax.copy_(absmax)
        else:
            offset = absmax.mean()
            quantized_absmax, nested = quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
            dequantize.quantized_absmax.copy_(quantized_absmax)
            dequantize.nested_absmax.copy_(nested.absmax)
            dequantize.nested_quant_map.copy_(nested.code)
            dequantize.offset.copy_(offset)
        return packed, dequantize

    def spec(self) -> dict:
        return experts_spec(self.quant_type, self.blocksize, self.double_quant)

    def quant_state(self):
        from bitsandbytes.functional import QuantState

        nested = None
        if self.double_quant:
            nested = QuantState(
                self.nested_absmax, code=self.nested_quant_map, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32
            )
        return QuantState(
            self.quantized_absmax if self.double_quant else self.absmax,
            shape=self.shape,
            code=self.quant_map,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=self.offset if self.double_quant else None,
            state2=nested,
        )

    @torch.no_grad()
    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(packed, self.quant_state())


# The experts' forward reads each tensor once per chosen expert: without torch's parametrization cache every read
# would dequantize the whole tensor again. The cache lives for one forward of the module (as bitsandbytes does).
def _enable_dequantize_cache(module: nn.Module, inputs) -> None:
    parametrize._cache_enabled += 1


def _disable_dequantize_cache(module: nn.Module, inputs, output) -> None:
    parametrize._cache_enabled = max(0, parametrize._cache_enabled - 1)
    if not parametrize._cache_enabled:
        parametrize._cache = {}


__all__ = [
    "FP32_STATISTICS",
    "UNQUANTIZED_MODULES",
    "Clover4bitDequantize",
    "CloverInt8Dequantize",
    "fused_expert_modules",
    "load_time_spec",
    "prepare_quantized_storage",
    "quantize_experts",
    "stored_spec",
    "unpack_cpu_4bit_layers",
    "with_unquantized_gates",
]
