"""A Clover (or Qwen3.5-MoE) checkpoint as a GGUF file llama.cpp loads (architecture `qwen35moe`).

Clover's weights carry Qwen3.5-MoE's names and shapes (docs/DESIGN.md §2), so the file is a plain `qwen35moe`
GGUF: llama.cpp runs its causal forward as is, and block diffusion on top of it (`llama_cpp_clover`). Clover's own
facts travel as extra keys (`clover.mask_token_id`, `clover.block_size`, `clover.threshold`).

What llama.cpp's `qwen35moe` loader expects of the weights, and how they differ from the checkpoint's:

* RMSNorm weights are stored as the multiplier itself: Qwen3.5 scales by `1 + w` (except the Gated DeltaNet output
  norm, which scales by `w`), so `1` is added here.
* `A_log` is stored as `A = -exp(A_log)`; the conv kernel `(channels, 1, kernel)` without its middle axis.
* Gated DeltaNet value heads: the checkpoint groups them by key head (`k0: v0 v1, k1: v0 v1`), ggml broadcasts
  key heads over value heads tiled (`k0 k1 k0 k1`): every tensor indexed by value head is permuted to that order.
* The fused experts `gate_up_proj` (experts, 2 * ff, hidden) are stored as two tensors, gate and up.
* Names through gguf's own map (`gguf.get_tensor_name_map`); dimensions are written reversed, as ggml reads them.

Quantized types (q8_0, q4_k_m) are made by llama.cpp's own quantizer from a float file written first.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ARCH_NAME = "qwen35moe"
# Output types: (the float type of the weights written here, the llama.cpp quantization applied after, if any).
GGUF_TYPES = {
    "f32": ("f32", None),
    "f16": ("f16", None),
    "bf16": ("bf16", None),
    "q8_0": (None, "Q8_0"),
    "q4_k_m": (None, "Q4_K_M"),
}
# The BPE pre-tokenizer split regexes llama.cpp knows for this family (tokenizer.json's Split pattern -> name).
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",  # noqa: E501
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",  # noqa: E501
}
SUPPORTED_MODEL_TYPES = ("clover", "qwen3_5_moe", "qwen3_5_moe_text")
DEFAULT_MROPE_SECTION = [11, 11, 10]  # Qwen3.5's interleaved M-RoPE; for text all sections read one position
# Always F32 in llama.cpp files, whatever the type: the routers and the depthwise conv (besides 1-D tensors).
KEEP_F32_SUFFIXES = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
CLOVER_KEYS = ("clover.mask_token_id", "clover.block_size", "clover.threshold", "clover.eos_token_ids")


@dataclass
class _Tensor:
    name: str  # the GGUF name
    shape: tuple[int, ...]  # torch order
    load: Callable[[], torch.Tensor]  # float32, transformed


# --------------------------------------------------------------------------------------------------------------------
# Reading the checkpoint
# --------------------------------------------------------------------------------------------------------------------


def read_text_config(model_dir: Path) -> tuple[dict, str]:
    """The text model's config fields and the model_type, or a ValueError saying what this exporter takes."""
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: no such directory; pass a Clover or Qwen3.5-MoE checkpoint directory.")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {model_dir}: no config.json there; pass a checkpoint directory (from_pretrained's)."
        )
    config = json.loads(path.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"--model {model_dir} is a {model_type!r} checkpoint; this exporter writes the Qwen3.5-MoE architecture "
            f"and takes {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints. For other models use llama.cpp's own "
            "convert_hf_to_gguf.py."
        )
    text = config.get("text_config", config) if model_type == "qwen3_5_moe" else config
    if text.get("experts_quantization"):
        raise ValueError(
            f"--model {model_dir} stores its experts quantized ({text['experts_quantization']}); export the 16-bit "
            "checkpoint and pick --type q8_0 or q4_k_m instead."
        )
    return text, model_type


def _layer_types(config: dict) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config["num_hidden_layers"])
        ]
    return list(types)


class _Checkpoint:
    """The safetensors of a checkpoint, one file or sharded, read tensor by tensor (never all at once)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (model_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ValueError(
                f"--model {model_dir}: no model.safetensors (or its index) there; save the model with "
                "save_pretrained(..., safe_serialization=True)."
            )
        self.handles = {}
        self.where = {}
        for file in files:
            handle = safe_open(str(model_dir / file), framework="pt")
            self.handles[file] = handle
            for key in handle.keys():
                # A full Qwen3.5-MoE keeps the text model under model.language_model; the vision tower and the
                # multi-token-prediction head have no place in a text GGUF.
                name = key.replace("model.language_model.", "model.")
                if name.startswith(("model.visual.", "mtp.")):
                    continue
                self.where[name] = (file, key)

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self.where[name]
        return tuple(self.handles[file].get_slice(key).get_shape())

    def dtype(self) -> str:
        file, key = self.where["model.embed_tokens.weight"]
        return self.handles[file].get_slice(key).get_dtype()

    def load(self, name: str) -> torch.Tensor:
        file, key = self.where[name]
        return self.handles[file].get_tensor(key).float()


# --------------------------------------------------------------------------------------------------------------------
# The weights in llama.cpp's layout
# --------------------------------------------------------------------------------------------------------------------


def _tiled_value_heads(tensor: torch.Tensor, dim: int, key_heads: int, value_heads: int, head_dim: int):
    """Value heads along `dim` from grouped-by-key-head order to tiled order (see the module docstring)."""
    if key_heads == value_heads:
        return tensor
    shape = list(tensor.shape)
    grouped = tensor.reshape(*shape[:dim], key_heads, value_heads // key_heads, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _plan(checkpoint: _Checkpoint, config: dict) -> list[_Tensor]:
    """Every tensor of the GGUF file, in writing order, with its shape and a loader applying the transforms."""
    import gguf

    num_layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, num_layers)
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    plan: list[_Tensor] = []

    def gguf_name(hf_name: str) -> str:
        stem, suffix = (hf_name[: -len(".weight")], ".weight") if hf_name.endswith(".weight") else (hf_name, "")
        mapped = name_map.get_name(stem)
        if mapped is None:
            raise ValueError(f"The checkpoint tensor {hf_name} has no place in a {ARCH_NAME} GGUF.")
        return mapped + suffix

    def add(hf_name: str, transform: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, name=None, shape=None):
        plan.append(
            _Tensor(
                name or gguf_name(hf_name),
                shape or checkpoint.shape(hf_name),
                lambda: transform(checkpoint.load(hf_name)).contiguous(),
            )
        )

    def plus_one(tensor):  # Qwen3.5's RMSNorm multiplies by (1 + w)
        return tensor + 1

    def value_rows(head_dim):
        return lambda t: _tiled_value_heads(t, 0, key_heads, value_heads, head_dim)

    def qkv_rows(tensor):  # q and k rows stay, the v rows are reordered
        qk = 2 * key_heads * key_dim
        return torch.cat([tensor[:qk], _tiled_value_heads(tensor[qk:], 0, key_heads, value_heads, value_dim)])

    add("model.embed_tokens.weight")
    for layer, layer_type in enumerate(_layer_types(config)):
        p = f"model.layers.{layer}."
        add(p + "input_layernorm.weight", plus_one)
        add(p + "post_attention_layernorm.weight", plus_one)
        if layer_type == "linear_attention":
            a = p + "linear_attn."
            add(a + "in_proj_qkv.weight", qkv_rows)
            add(a + "in_proj_z.weight", value_rows(value_dim))
            add(a + "in_proj_a.weight", value_rows(1))
            add(a + "in_proj_b.weight", value_rows(1))
            add(a + "A_log", lambda t: -torch.exp(value_rows(1)(t)), name=f"blk.{layer}.ssm_a")
            add(a + "dt_bias", value_rows(1), name=f"blk.{layer}.ssm_dt.bias")
            conv = checkpoint.shape(a + "conv1d.weight")
            add(a + "conv1d.weight", lambda t: qkv_rows(t.squeeze(1)), shape=(conv[0], conv[2]))
            add(a + "norm.weight")  # the gated output norm multiplies by w itself
            add(a + "out_proj.weight", lambda t: _tiled_value_heads(t, 1, key_heads, value_heads, value_dim))
        elif layer_type == "full_attention":
            for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
                add(p + f"self_attn.{part}.weight")
            add(p + "self_attn.q_norm.weight", plus_one)
            add(p + "self_attn.k_norm.weight", plus_one)
        else:
            raise ValueError(f"Layer {layer} is of type {layer_type!r}; a {ARCH_NAME} GGUF holds linear_attention "
                             "and full_attention layers only.")  # fmt: skip
        m = p + "mlp."
        add(m + "gate.weight")
        if checkpoint.has(m + "experts.gate_up_proj"):  # transformers' fused layout (Clover's)
            experts, double_ff, hidden = checkpoint.shape(m + "experts.gate_up_proj")
            ff = double_ff // 2
            add(m + "experts.gate_up_proj", lambda t, ff=ff: t[:, :ff], name=f"blk.{layer}.ffn_gate_exps.weight", shape=(experts, ff, hidden))  # fmt: skip
            add(m + "experts.gate_up_proj", lambda t, ff=ff: t[:, ff:], name=f"blk.{layer}.ffn_up_exps.weight", shape=(experts, ff, hidden))  # fmt: skip
            add(m + "experts.down_proj", name=f"blk.{layer}.ffn_down_exps.weight")
        else:  # one tensor per expert, as Qwen's released checkpoints store them: stacked
            for part, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                names = [f"{m}experts.{e}.{part}.weight" for e in range(config["num_experts"])]
                if not checkpoint.has(names[0]):
                    raise ValueError(f"The checkpoint has neither {m}experts.gate_up_proj nor {names[0]}: not a "
                                     "Qwen3.5-MoE layout this exporter knows.")  # fmt: skip
                plan.append(
                    _Tensor(
                        f"blk.{layer}.ffn_{short}_exps.weight",
                        (len(names), *checkpoint.shape(names[0])),
                        lambda names=names: torch.stack([checkpoint.load(n) for n in names]),
                    )
                )
        for part in ("gate_proj", "up_proj", "down_proj"):
            add(m + f"shared_expert.{part}.weight")
        add(m + "shared_expert_gate.weight")
    add("model.norm.weight", plus_one)
    if checkpoint.has("lm_head.weight"):
        add("lm_head.weight")  # absent (tied embeddings): llama.cpp reads the output from token_embd
    return plan


# --------------------------------------------------------------------------------------------------------------------
# Metadata: hyperparameters, tokenizer, chat template, Clover's facts
# --------------------------------------------------------------------------------------------------------------------


def _pre_tokenizer(tokenizer: dict, model_dir: Path) -> str:
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    patterns = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split" and "pattern" in s]
    for pattern in patterns:
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    raise ValueError(
        f"{model_dir / 'tokenizer.json'}: its pre-tokenizer split {patterns or pre!r} is not Qwen3.5's or Qwen2's; "
        "llama.cpp would split text differently from the model's tokenizer. Export a checkpoint saved with the "
        "Qwen3.5 tokenizer (tokenization_clover)."
    )


def _add_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:
    import gguf

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"--model {model_dir}: no tokenizer.json there; save the tokenizer beside the weights.")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    if tokenizer.get("model", {}).get("type") != "BPE":
        raise ValueError(
            f"{path}: a {tokenizer.get('model', {}).get('type')!r} tokenizer; Qwen3.5's is byte-level BPE."
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in tokenizer["model"]["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in tokenizer.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tokenizer, model_dir))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # Merges, special token ids and the chat template (chat_template.jinja or tokenizer_config.json), read by gguf.
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer)


def _add_hyperparameters(writer, config: dict, file_type: int) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    layer_types = _layer_types(config)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_rope_dimension_sections([*rope.get("mrope_section", DEFAULT_MROPE_SECTION), 0][:4])
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    # Which layers are Gated DeltaNet: the loader reads this list before any interval, so any layout works.
    writer.add_array(f"{ARCH_NAME}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if full:
        writer.add_full_attention_interval(full[0] + 1)
    writer.add_file_type(file_type)


def _add_clover_facts(writer, model_dir: Path, config: dict, model_type: str) -> None:
    if model_type != "clover":
        return
    path = model_dir / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    writer.add_uint32("clover.mask_token_id", config["mask_token_id"])
    writer.add_uint32("clover.block_size", config["block_size"])
    writer.add_float32("clover.threshold", float(generation.get("threshold", 0.95)))
    if eos is not None:  # generate stops at any of these (the tokenizer's EOS is only one of them)
        writer.add_array("clover.eos_token_ids", [eos] if isinstance(eos, int) else list(eos))


# --------------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------------


def _storage(name: str, shape: tuple[int, ...], float_type: str):
    """(ggml type, numpy converter) of a tensor in a float file."""
    import gguf

    if float_type == "f32" or len(shape) <= 1 or name.endswith(("_norm.weight", *KEEP_F32_SUFFIXES)):
        return gguf.GGMLQuantizationType.F32, lambda t: t.float().numpy()
    if float_type == "f16":
        return gguf.GGMLQuantizationType.F16, lambda t: t.half().numpy()
    return gguf.GGMLQuantizationType.BF16, lambda t: t.bfloat16().view(torch.int16).numpy()


def _write_float_gguf(model_dir: Path, output: Path, float_type: str, name: str | None) -> None:
    import gguf

    config, model_type = read_text_config(model_dir)
    checkpoint = _Checkpoint(model_dir)
    plan = _plan(checkpoint, config)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}  # fmt: skip
    writer = gguf.GGUFWriter(output, ARCH_NAME)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or model_dir.resolve().name)
    _add_hyperparameters(writer, config, int(file_types[float_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, model_dir, config["vocab_size"])
    _add_clover_facts(writer, model_dir, config, model_type)
    converters = []
    for tensor in plan:
        ggml_type, convert = _storage(tensor.name, tensor.shape, float_type)
        bytes_per_value = 4 if ggml_type == gguf.GGMLQuantizationType.F32 else 2
        dtype = np.float32 if bytes_per_value == 4 else np.float16 if float_type == "f16" else np.int16
        nbytes = int(np.prod(tensor.shape)) * bytes_per_value
        writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(dtype), nbytes, raw_dtype=ggml_type)
        converters.append(convert)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, convert in zip(plan, converters, strict=True):  # one tensor in memory at a time
        writer.write_tensor_data(convert(tensor.load()))
    writer.close()


def _quantize(source: Path, output: Path, quantization: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quantization}")
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(output).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({status}) on {source} -> {quantization}.")


def export_gguf(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    type: str = "f16",
    *,
    name: str | None = None,
    threads: int = 0,
) -> Path:
    """Writes the checkpoint at `model_dir` as a GGUF file at `output` of `type` (see `GGUF_TYPES`).

    The file appears complete or not at all: it is written beside `output` under a temporary name and renamed.
    q8_0 and q4_k_m are quantized by llama.cpp from a float file in the checkpoint's own precision (f32 for an f32
    checkpoint, else bf16). `threads`: the quantizer's threads (0: all cores). Returns the output path."""
    if type not in GGUF_TYPES:
        raise ValueError(f"--type {type!r} is not one of {', '.join(GGUF_TYPES)}; e.g. --type q8_0.")
    model_dir, output = Path(model_dir), Path(output)
    if output.is_dir():
        raise ValueError(f"--output {output} is a directory; pass a file name, e.g. {output / 'clover.gguf'}.")
    read_text_config(model_dir)  # a bad checkpoint fails before any file is made
    output.parent.mkdir(parents=True, exist_ok=True)
    float_type, quantization = GGUF_TYPES[type]
    temporaries = []
    try:
        staged = _temporary_beside(output, temporaries)
        if quantization is None:
            _write_float_gguf(model_dir, staged, float_type, name)
        else:
            source = _temporary_beside(output, temporaries)
            precision = "f32" if _Checkpoint(model_dir).dtype() == "F32" else "bf16"
            _write_float_gguf(model_dir, source, precision, name)
            _quantize(source, staged, quantization, threads)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staged, 0o666 & ~umask)  # mkstemp's file is private; the output gets the usual permissions
        os.replace(staged, output)
    finally:
        for path in temporaries:
            path.unlink(missing_ok=True)
    return output


def _temporary_beside(output: Path, temporaries: list[Path]) -> Path:
    handle, path = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent)
    os.close(handle)
    temporaries.append(Path(path))
    return Path(path)


def read_clover_metadata(path: str | os.PathLike) -> dict:
    """Clover's keys of a GGUF file (`CLOVER_KEYS`, without the prefix); empty for a plain Qwen3.5-MoE file."""
    import gguf

    reader = gguf.GGUFReader(path)
    facts = {}
    for key in CLOVER_KEYS:
        field = reader.get_field(key)
        if field is not None:
            facts[key.split(".", 1)[1]] = field.contents()
    return facts


def iter_tensor_names(model_dir: str | os.PathLike) -> Iterator[str]:
    """The GGUF tensor names the checkpoint at `model_dir` exports to, in writing order."""
    config, _ = read_text_config(Path(model_dir))
    yield from (t.name for t in _plan(_Checkpoint(Path(model_dir)), config))


__all__ = ["ARCH_NAME", "CLOVER_KEYS", "GGUF_TYPES", "export_gguf", "iter_tensor_names", "read_clover_metadata"]
