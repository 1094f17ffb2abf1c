"""Convert a Hugging Face Qwen3.5-MoE checkpoint into a Clover checkpoint (docs/DESIGN.md §2).

    python scripts/convert_qwen3_5_moe.py --input Qwen3.6-35B-A3B --output clover-35b-a3b-init

* Weights: the text stack keeps transformers' Qwen3.5-MoE text names. `model.language_model.*` (the multimodal
  layout, and what transformers 5.2 writes even for the text-only model) becomes `model.*`; per-expert weights
  (`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`) are fused into `mlp.experts.gate_up_proj` (experts,
  2 * inter, hidden; gate rows first) and `mlp.experts.down_proj` (experts, hidden, inter). Vision (`model.visual.*`)
  and multi-token-prediction (`mtp.*`) weights are dropped and counted.
* Config: a `CloverConfig` built from the text config (top level, or `text_config` of the multimodal config), with
  `mask_token_id` and `block_size`; a `CloverGenerationConfig` (threshold 0.95); the three code files, so the
  checkpoint loads with `trust_remote_code=True`; the input's tokenizer, with `<|mask|>` added when it can be.
* Mask embedding: the base never trained row `mask_token_id`, so it is near zero, and a zero row normalises to
  noise in the first RMSNorm. It is set to the mean of the ordinary-vocabulary rows, a neutral "unknown token" start
  (docs/DESIGN.md §7). `lm_head` is left as is: the mask token is
  never predicted (generation sets its logit to -inf).
* Streaming: one input shard at a time (memory-mapped), output shards of at most `max_shard_size`; the memory held
  is about one output shard plus the per-expert pieces of layers not yet complete.
* Safety: everything is written into a temporary directory beside the output and renamed at the end; on any
  error it is removed, so there is never a half-written output.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PretrainedConfig
from transformers.utils import logging
from transformers.utils.hub import convert_file_size_to_int

from .cli_clover import replace_directory
from .configuration_clover import CloverConfig
from .generation_clover import CloverGenerationConfig

logger = logging.get_logger(__name__)

MASK_TOKEN = "<|mask|>"
DEFAULT_MASK_TOKEN_ID = 248077  # the first free id after Qwen3.5's added tokens (docs/DESIGN.md §2)
QWEN3_5_NUM_RANKS = 248_044  # Qwen3.5's BPE vocabulary: ids [0, 248044) are ordinary tokens
# The files a checkpoint carries and runs under trust_remote_code (modeling imports the others).
CODE_FILES = (
    "configuration_clover.py",
    "modeling_clover.py",
    "generation_clover.py",
    "cache_clover.py",
    "quantization_clover.py",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
QWEN_TEXT_MODEL_TYPES = ("qwen3_5_moe_text",)
QWEN_MULTIMODAL_MODEL_TYPES = ("qwen3_5_moe",)
DROPPED_PREFIXES = {"vision": ("model.visual.", "visual."), "mtp": ("mtp.",)}
PER_EXPERT_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# Fields handled on their own, or that describe the file rather than the architecture: never reported as ignored.
HANDLED_FIELDS = {
    *ROPE_FIELDS, *TOKEN_FIELDS, "tie_word_embeddings",
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "auto_map", "_name_or_path",
}  # fmt: skip


@dataclass
class ConversionReport:
    """What `convert_qwen3_5_moe` wrote; `summary()` is the text the CLI prints."""

    output_dir: Path
    dtype: torch.dtype
    num_tensors: int = 0
    num_bytes: int = 0
    num_shards: int = 0
    num_fused_layers: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    mask_token_id: int = DEFAULT_MASK_TOKEN_ID
    num_ordinary_tokens: int = 0
    mask_row_norm_before: float = 0.0
    mask_row_norm_after: float = 0.0
    tokenizer: str = "none in the input"
    ignored_config_fields: list[str] = field(default_factory=list)

    def summary(self) -> str:
        dropped = ", ".join(f"{count} {kind}" for kind, count in self.dropped.items() if count) or "none"
        lines = [
            f"Clover checkpoint -> {self.output_dir}",
            f"  tensors written: {self.num_tensors} ({self.num_bytes / 1e9:.2f} GB, {self.num_shards} shard(s), "
            f"{str(self.dtype).removeprefix('torch.')})",
            f"  per-expert weights fused: {self.num_fused_layers} layer(s)",
            f"  tensors dropped: {dropped}",
            f"  mask embedding: row {self.mask_token_id} set to the mean of rows [0, {self.num_ordinary_tokens}) "
            f"(norm {self.mask_row_norm_before:.4g} -> {self.mask_row_norm_after:.4g}); lm_head unchanged",
            f"  tokenizer: {self.tokenizer}",
        ]
        if self.ignored_config_fields:
            lines.append(f"  config fields not carried over: {', '.join(self.ignored_config_fields)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------------


def read_text_config(input_dir: Path) -> tuple[dict, dict]:
    """The input's config.json and its text part (the top level, or `text_config` of the multimodal config)."""
    path = input_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{input_dir} has no config.json: is it a Hugging Face Qwen3.5-MoE checkpoint directory?")
    config = json.loads(path.read_text())
    model_type = config.get("model_type")
    if model_type in QWEN_MULTIMODAL_MODEL_TYPES:
        return config, config["text_config"]
    if model_type in QWEN_TEXT_MODEL_TYPES:
        return config, config
    raise ValueError(
        f"{path} has model_type {model_type!r}; expected one of "
        f"{list(QWEN_TEXT_MODEL_TYPES + QWEN_MULTIMODAL_MODEL_TYPES)} (a Qwen3.5-MoE checkpoint)."
    )


def clover_config_from_qwen(
    config: dict, text_config: dict, mask_token_id: int = DEFAULT_MASK_TOKEN_ID, block_size: int = 32
) -> tuple[CloverConfig, list[str]]:
    """A `CloverConfig` with the architecture of a Qwen3.5-MoE config (field for field), plus the diffusion fields.

    Returns the config and the names of the text-config fields it does not carry (e.g. `mtp_num_hidden_layers`).
    """
    generic = set(inspect.signature(PretrainedConfig.__init__).parameters)
    accepted = set(inspect.signature(CloverConfig.__init__).parameters) - generic - {"self", "kwargs"}
    accepted -= {"block_size", "mask_token_id", "rope_parameters", "tie_word_embeddings"}
    fields = {name: value for name, value in text_config.items() if name in accepted}
    ignored = sorted(set(text_config) - accepted - HANDLED_FIELDS)

    vocab_size = text_config["vocab_size"]
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"The checkpoint's vocabulary has {vocab_size} rows, so mask_token_id {mask_token_id} does not fit: pass "
            f"--mask-token-id with a free id below {vocab_size} (Qwen3.5's is {DEFAULT_MASK_TOKEN_ID})."
        )
    # Token ids: the text config's, else the top level's, else Clover's defaults when they fit the vocabulary.
    defaults = inspect.signature(CloverConfig.__init__).parameters
    for name in TOKEN_FIELDS:
        value = text_config.get(name, config.get(name))
        if value is None:
            default = defaults[name].default
            value = default if isinstance(default, int) and default < vocab_size else None
        fields[name] = value
    tie = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    clover = CloverConfig(
        **fields,
        rope_parameters=_rope_parameters(text_config),
        tie_word_embeddings=bool(tie),
        mask_token_id=mask_token_id,
        block_size=block_size,
    )
    return clover, ignored


def _rope_parameters(text_config: dict) -> dict:
    """Qwen3.5 configs spell theta and the partial rotary factor at the top level or inside rope_parameters (or the
    older rope_scaling). The mRoPE sections only matter for image positions: text positions are plain RoPE."""
    nested = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    rope_type = nested.get("rope_type", nested.get("type", "default"))
    parameters = {"rope_type": "default" if rope_type in ("default", "mrope") else rope_type}
    for name in ("rope_theta", "partial_rotary_factor"):
        value = nested.get(name, text_config.get(name))
        if value is not None:
            parameters[name] = value
    return parameters


# --------------------------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------------------------


def input_shards(input_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order (or the single `model.safetensors`)."""
    index = input_dir / "model.safetensors.index.json"
    if index.is_file():
        names = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (input_dir / name).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not in {input_dir}: {', '.join(missing)}.")
        return [input_dir / name for name in names]
    single = input_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{input_dir} has neither model.safetensors nor model.safetensors.index.json.")


def read_shard(path: Path):
    """Yields (name, tensor) for each tensor of one safetensors file, one at a time."""
    try:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"Could not read {path}: {error}. The file is truncated or corrupt: download it again."
        ) from error


def clover_name(source_name: str) -> tuple[str, str | None]:
    """(kind, output name): kind "keep" with the Clover name, or the reason it is dropped ("vision", "mtp")."""
    for kind, prefixes in DROPPED_PREFIXES.items():
        if source_name.startswith(prefixes):
            return kind, None
    if source_name.startswith("model.language_model."):
        return "keep", "model." + source_name.removeprefix("model.language_model.")
    return "keep", source_name


class ExpertFuser:
    """Collects per-expert weights until a layer has all of them, then fuses them into transformers' 3D layout.

    gate_up_proj[e] = cat(gate_proj[e], up_proj[e]) along the output dim: (experts, 2 * inter, hidden);
    down_proj[e] = down_proj[e]: (experts, hidden, inter).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.pending: dict[int, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, layer: int, expert: int, kind: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Stores one piece; returns the fused tensors of the layer once it is complete, else []."""
        if expert >= self.num_experts:
            raise ValueError(f"Layer {layer} has expert {expert}, but the config says num_experts={self.num_experts}.")
        pieces = self.pending.setdefault(layer, {})
        pieces[expert, kind] = tensor
        if len(pieces) < 3 * self.num_experts:
            return []
        del self.pending[layer]
        experts = range(self.num_experts)
        gate_up = torch.stack([torch.cat([pieces[e, "gate_proj"], pieces[e, "up_proj"]]) for e in experts])
        down = torch.stack([pieces[e, "down_proj"] for e in experts])
        prefix = f"model.layers.{layer}.mlp.experts"
        return [(f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)]

    def check_complete(self) -> None:
        for layer, pieces in self.pending.items():
            missing = [
                f"experts.{e}.{kind}"
                for e in range(self.num_experts)
                for kind in ("gate_proj", "up_proj", "down_proj")
                if (e, kind) not in pieces
            ]
            raise ValueError(f"Layer {layer} lacks {len(missing)} per-expert weights, e.g. {', '.join(missing[:3])}.")


class ShardWriter:
    """Writes tensors into safetensors files of at most `max_shard_size` bytes (a larger tensor gets its own file),
    named as transformers names them, with an index when there is more than one."""

    def __init__(self, directory: Path, max_shard_size: int):
        self.directory = directory
        self.max_shard_size = max_shard_size
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + size > self.max_shard_size:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        path = self.directory / f"part-{len(self.files):05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        self.buffer, self.buffer_bytes = {}, 0

    def finish(self) -> int:
        """Writes the last shard, gives every shard its final name and writes the index; returns the shard count."""
        if self.buffer:
            self.flush()
        count = len(self.files)
        if count == 1:
            self.files[0][0].rename(self.directory / "model.safetensors")
            return 1
        weight_map = {}
        for number, (path, names) in enumerate(self.files, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return count


def mean_embedding_init(embedding: torch.Tensor, mask_token_id: int, num_ordinary_tokens: int) -> torch.Tensor:
    """A copy of `embedding` whose row `mask_token_id` is the mean of rows [0, num_ordinary_tokens).

    The mean is accumulated in fp32 over slices of rows, so it never holds a second fp32 copy of the table.
    """
    if not 0 < num_ordinary_tokens <= embedding.shape[0]:
        raise ValueError(f"num_ordinary_tokens ({num_ordinary_tokens}) must be in [1, {embedding.shape[0]}].")
    total = torch.zeros(embedding.shape[1], dtype=torch.float32)
    for start in range(0, num_ordinary_tokens, 16384):
        total += embedding[start : min(start + 16384, num_ordinary_tokens)].float().sum(0)
    result = embedding.clone()
    result[mask_token_id] = (total / num_ordinary_tokens).to(embedding.dtype)
    return result


def expected_shapes(config: CloverConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Clover checkpoint with this config holds (from a model on the meta device)."""
    from .modeling_clover import CloverForBlockDiffusion  # the model only here: the config stays importable alone

    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------------


def ordinary_vocab_size(input_dir: Path, mask_token_id: int) -> int:
    """How many leading ids are ordinary tokens: the tokenizer's base vocabulary when tokenizer.json is there (its
    ids 0..n-1), else the ids below both the mask id and Qwen3.5's 248,044 BPE ranks."""
    path = input_dir / "tokenizer.json"
    if path.is_file():
        vocab = json.loads(path.read_text()).get("model", {}).get("vocab")
        if isinstance(vocab, dict) and vocab and sorted(vocab.values()) == list(range(len(vocab))):
            return min(len(vocab), mask_token_id)
    return min(mask_token_id, QWEN3_5_NUM_RANKS)


def copy_tokenizer(input_dir: Path, output_dir: Path, mask_token_id: int) -> str:
    """Copies the input's tokenizer files and makes sure `<|mask|>` is token `mask_token_id`; returns what it did.

    A Qwen3.5 tokenizer ends at id 248076, so `<|mask|>` is appended as a special token and lands on 248077. When
    it cannot land on `mask_token_id`, the files are copied unchanged and the status says so.
    """
    copied = [name for name in TOKENIZER_FILES if (input_dir / name).is_file()]
    if not copied:
        return "none in the input: add one with tokenization_clover.copy_clover_tokenizer"
    for name in copied:
        shutil.copyfile(input_dir / name, output_dir / name)
    if "tokenizer.json" not in copied:
        return f"copied {', '.join(copied)}; no tokenizer.json, so {MASK_TOKEN} was not checked"

    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(output_dir / "tokenizer.json"))
    existing = tokenizer.token_to_id(MASK_TOKEN)
    if existing == mask_token_id:
        return f"copied; it has {MASK_TOKEN} = {mask_token_id}"
    if existing is not None:
        raise ValueError(
            f"The input tokenizer has {MASK_TOKEN} = {existing}, but mask_token_id is {mask_token_id}: pass "
            f"--mask-token-id {existing}."
        )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != mask_token_id:
        logger.warning(f"The input tokenizer lacks {MASK_TOKEN} and cannot take it at id {mask_token_id}.")
        return (
            f"copied; it LACKS {MASK_TOKEN} (its next id is {size}, not {mask_token_id}): install the Clover "
            "tokenizer with tokenization_clover.copy_clover_tokenizer (scripts/build_tokenizer.py --model-dir)"
        )
    tokenizer.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(MASK_TOKEN) == mask_token_id
    tokenizer.save(str(output_dir / "tokenizer.json"))
    if "tokenizer_config.json" in copied:
        _declare_mask_token(output_dir / "tokenizer_config.json", mask_token_id)
    return f"copied; the input lacked {MASK_TOKEN}, added as special token {mask_token_id}"


def _declare_mask_token(path: Path, mask_token_id: int) -> None:
    config = json.loads(path.read_text())
    config["mask_token"] = MASK_TOKEN
    if isinstance(config.get("added_tokens_decoder"), dict):
        config["added_tokens_decoder"][str(mask_token_id)] = {
            "content": MASK_TOKEN, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }  # fmt: skip
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(config.get(key), list) and MASK_TOKEN not in config[key]:
            config[key].append(MASK_TOKEN)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------------------


def convert_qwen3_5_moe(
    input_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    mask_token_id: int = DEFAULT_MASK_TOKEN_ID,
    block_size: int = 32,
    max_shard_size: int | str = "2GB",
    force: bool = False,
    progress: bool = True,
) -> ConversionReport:
    """Converts the Qwen3.5-MoE checkpoint in `input_dir` into a Clover checkpoint in `output_dir`.

    1. read the input config, build the CloverConfig and the expected tensor shapes;
    2. stage a temporary directory beside the output;
    3. stream the input shards: rename, drop vision/MTP, fuse per-expert weights, cast to `dtype`, set the mask
       embedding row to the mean ordinary-token row, check names and shapes, write bounded output shards;
    4. write config.json (with auto_map), generation_config.json, the code files and the tokenizer;
    5. replace the output by the staged directory (only with `force` if it exists and is not empty).

    Raises ValueError for anything the user can fix (existing output, missing or corrupt files, a mask id outside
    the vocabulary, weights that do not match the config); the output is then left as it was.
    """
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    if output_dir == input_dir or input_dir.is_relative_to(output_dir):
        raise ValueError(f"The output {output_dir} must not be (or contain) the input {input_dir}.")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())) and not force:
        raise ValueError(f"{output_dir} already exists and is not empty: pass --force (force=True) to replace it.")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype ({dtype}) must be a floating-point type, e.g. torch.bfloat16.")

    # 1. config
    config_dict, text_config = read_text_config(input_dir)
    config, ignored = clover_config_from_qwen(config_dict, text_config, mask_token_id, block_size)
    config.dtype = dtype
    shapes = expected_shapes(config)
    shards = input_shards(input_dir)
    report = ConversionReport(output_dir, dtype, mask_token_id=mask_token_id, ignored_config_fields=ignored)
    report.dropped = {"vision": 0, "mtp": 0, "tied lm_head": 0}
    report.num_ordinary_tokens = ordinary_vocab_size(input_dir, mask_token_id)

    # 2. staging directory, removed on any error
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = output_dir.with_name(f".{output_dir.name}.converting-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()  # not mkdtemp: its 0700 mode would become the output's
    try:
        # 3. tensors
        writer = ShardWriter(staging, convert_file_size_to_int(max_shard_size))
        fuser = ExpertFuser(config.num_experts)
        written: set[str] = set()

        def emit(name: str, tensor: torch.Tensor) -> None:
            if name not in shapes:
                raise ValueError(f"The input holds {name!r}, which is not a Qwen3.5-MoE text weight of this config.")
            if tuple(tensor.shape) != shapes[name]:
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)} but the config implies {shapes[name]}: the config.json "
                    "does not describe these weights."
                )
            if name in written:
                raise ValueError(f"{name} appears twice in the input shards.")
            if name == "model.embed_tokens.weight":
                report.mask_row_norm_before = float(tensor[mask_token_id].float().norm())
                tensor = mean_embedding_init(tensor, mask_token_id, report.num_ordinary_tokens)
                report.mask_row_norm_after = float(tensor[mask_token_id].float().norm())
            written.add(name)
            writer.add(name, tensor)

        for shard in tqdm(shards, desc="Converting shards", unit="shard", disable=not progress):
            for source_name, tensor in read_shard(shard):
                kind, name = clover_name(source_name)
                if kind != "keep":
                    report.dropped[kind] += 1
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    report.dropped["tied lm_head"] += 1
                    continue
                tensor = tensor.to(dtype)
                per_expert = PER_EXPERT_WEIGHT.match(name)
                if per_expert is None:
                    emit(name, tensor)
                    continue
                layer, expert, piece = int(per_expert[1]), int(per_expert[2]), per_expert[3]
                fused = fuser.add(layer, expert, piece, tensor)
                report.num_fused_layers += bool(fused)
                for fused_name, fused_tensor in fused:
                    emit(fused_name, fused_tensor)
        fuser.check_complete()
        missing = sorted(set(shapes) - written)
        if missing:
            raise ValueError(f"The input lacks {len(missing)} weights of this config, e.g. {', '.join(missing[:3])}.")
        report.num_shards = writer.finish()
        report.num_tensors, report.num_bytes = len(written), writer.total_bytes

        # 4. config, generation config, code, tokenizer
        config.save_pretrained(staging)
        generation_config = CloverGenerationConfig.from_model_config(config)
        generation_config.threshold = 0.95
        # The base's own turn enders (Qwen's generation config ends a turn at <|im_end|> or <|endoftext|>).
        generation_config.update(**base_generation_tokens(input_dir))
        generation_config.save_pretrained(staging)
        package_dir = Path(__file__).resolve().parent
        for name in CODE_FILES:
            shutil.copyfile(package_dir / name, staging / name)
        report.tokenizer = copy_tokenizer(input_dir, staging, mask_token_id)

        # 5. publish
        replace_directory(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(report.summary())
    return report


def base_generation_tokens(input_dir: Path) -> dict:
    """eos/pad/bos ids of the input's generation_config.json, when it has one (sampling settings are not taken:
    block diffusion decodes greedily unless asked)."""
    path = input_dir / "generation_config.json"
    if not path.is_file():
        return {}
    fields = json.loads(path.read_text())
    return {key: fields[key] for key in TOKEN_FIELDS if fields.get(key) is not None}


__all__ = [
    "ConversionReport",
    "clover_config_from_qwen",
    "convert_qwen3_5_moe",
    "mean_embedding_init",
]
