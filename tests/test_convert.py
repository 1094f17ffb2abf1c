"""Tests of the Qwen3.5-MoE -> Clover conversion: a tiny random transformers Qwen3.5-MoE, converted, must give the
same logits through `trust_remote_code`; every input layout must convert to the same tensors; a failed conversion
must leave nothing behind. Tiny models on CPU, seconds in all."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CODE_FILES, TINY_FIELDS, spy_experts_kernel
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from clover.conversion_clover import convert_qwen3_5_moe

REPO = Path(__file__).resolve().parents[1]
MASK_ID = 250  # a free id in the tiny vocabulary of 256
# The shared tiny architecture, with a vocabulary of 256 so the mask id has room (the converter adds it).
QWEN_FIELDS = {
    **{k: v for k, v in TINY_FIELDS.items() if k not in ("block_size", "mask_token_id", "layer_types")},
    "vocab_size": 256,
    "eos_token_id": 254,
}


def convert(input_dir, output_dir, **kwargs):
    return convert_qwen3_5_moe(input_dir, output_dir, dtype=torch.float32, mask_token_id=MASK_ID, progress=False, **kwargs)  # fmt: skip


def load_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def staged_leftovers(directory: Path) -> list[str]:
    return [path.name for path in directory.iterdir() if ".converting-" in path.name or ".replaced-" in path.name]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random Qwen3_5MoeForCausalLM (norms and dt_bias randomised, so a wrong convention shows), saved with
    save_pretrained in float32, with its logits on 140 tokens (more than one 64-token GDN chunk)."""
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**QWEN_FIELDS)).float().eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    input_ids = torch.randint(1, MASK_ID, (2, 140), generator=torch.Generator().manual_seed(0))  # no mask id
    with torch.no_grad():
        logits = model(input_ids).logits
    directory = tmp_path_factory.mktemp("qwen") / "qwen-text"
    model.save_pretrained(directory)
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    config = json.loads((directory / "config.json").read_text())
    return SimpleNamespace(dir=directory, state_dict=state_dict, config=config, input_ids=input_ids, logits=logits)


@pytest.fixture(scope="module")
def converted(qwen, tmp_path_factory):
    output = tmp_path_factory.mktemp("converted") / "clover"
    report = convert(qwen.dir, output)
    return SimpleNamespace(dir=output, report=report, tensors=load_checkpoint(output))


def write_fused_text_only(qwen, directory: Path) -> Path:
    """The layout of `Qwen3_5MoeForCausalLM` in memory: `model.*` keys, fused experts, one file."""
    directory.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in qwen.state_dict.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(qwen.config))
    return directory


def write_multimodal_per_expert_sharded(qwen, directory: Path) -> Path:
    """The multimodal layout: `model.language_model.*`, per-expert weights, vision and MTP tensors, a nested config
    with theta and the rotary factor at the top level of text_config, and two shards split inside layer 1's experts."""
    tensors = {}
    for name, tensor in qwen.state_dict.items():
        if name != "lm_head.weight":
            name = "model.language_model." + name.removeprefix("model.")
        prefix = name.rpartition(".")[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                tensors[f"{prefix}.{expert}.gate_proj.weight"] = gate.clone()
                tensors[f"{prefix}.{expert}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            for expert, down in enumerate(tensor):
                tensors[f"{prefix}.{expert}.down_proj.weight"] = down.clone()
        else:
            tensors[name] = tensor.contiguous()
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, 2)
    tensors["model.visual.merger.linear_fc2.weight"] = torch.randn(64, 16)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.norm.weight"] = torch.randn(64)

    names = sorted(tensors)
    split = names.index("model.language_model.layers.1.mlp.experts.4.down_proj.weight")
    directory.mkdir()
    weight_map = {}
    for number, part in enumerate([names[:split], names[split:]], start=1):
        file_name = f"model-{number:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, directory / file_name)
        weight_map.update(dict.fromkeys(part, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    text_config = {key: value for key, value in qwen.config.items() if key != "rope_parameters"}
    text_config.update(
        model_type="qwen3_5_moe_text",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        mtp_num_hidden_layers=1,
    )
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 16},
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def layouts(qwen, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return SimpleNamespace(
        fused=write_fused_text_only(qwen, root / "fused"),
        multimodal=write_multimodal_per_expert_sharded(qwen, root / "multimodal"),
    )


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_converted_checkpoint_gives_the_logits_of_the_qwen_model(qwen, converted, experts_implementation, monkeypatch):
    if experts_implementation not in ["eager", *ALL_EXPERTS_FUNCTIONS]:
        pytest.skip(f"this transformers has no {experts_implementation} experts")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            converted.dir, trust_remote_code=True, experts_implementation=experts_implementation
        ).eval()
    except (ValueError, ImportError) as error:
        pytest.skip(f"{experts_implementation} experts unavailable here: {error}")
    assert type(model).__module__.startswith("transformers_modules")  # the checkpoint's code, not the package
    assert model.config._experts_implementation == experts_implementation
    calls = spy_experts_kernel(monkeypatch, experts_implementation)
    with torch.no_grad():
        logits = model(qwen.input_ids).logits
    torch.testing.assert_close(logits, qwen.logits, atol=1e-4, rtol=1e-4)
    assert bool(calls) == (experts_implementation != "eager")


def test_mask_embedding_row_is_the_mean_of_the_ordinary_rows_and_nothing_else_changes(qwen, converted):
    source_embedding = qwen.state_dict["model.embed_tokens.weight"]
    embedding = converted.tensors["model.embed_tokens.weight"]
    # No tokenizer in the input: the ordinary rows are those below the mask id (and Qwen3.5's 248,044 BPE ranks).
    torch.testing.assert_close(embedding[MASK_ID], source_embedding[:MASK_ID].mean(0))
    others = torch.arange(256) != MASK_ID
    assert torch.equal(embedding[others], source_embedding[others])
    assert torch.equal(converted.tensors["lm_head.weight"], qwen.state_dict["lm_head.weight"])
    assert converted.report.num_ordinary_tokens == MASK_ID


def test_output_carries_config_auto_map_generation_config_and_code(converted):
    config = json.loads((converted.dir / "config.json").read_text())
    assert config["model_type"] == "clover" and config["architectures"] == ["CloverForBlockDiffusion"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert (config["mask_token_id"], config["block_size"], config["dtype"]) == (MASK_ID, 32, "float32")
    assert config["rope_parameters"] == QWEN_FIELDS["rope_parameters"]
    generation = json.loads((converted.dir / "generation_config.json").read_text())
    assert (generation["threshold"], generation["mask_token_id"], generation["block_size"]) == (0.95, MASK_ID, 32)
    for name in CODE_FILES:
        assert (converted.dir / name).read_bytes() == (REPO / name).read_bytes()
    assert sorted(path.name for path in converted.dir.iterdir()) == sorted(
        [*CODE_FILES, "config.json", "generation_config.json", "model.safetensors"]
    )


# ------------------------------------------------------------------------------------------------ input layouts


def test_fused_text_only_input_converts_to_the_same_tensors(qwen, converted, layouts, tmp_path):
    report = convert(layouts.fused, tmp_path / "out")
    assert_same_tensors(load_checkpoint(tmp_path / "out"), converted.tensors)
    assert report.num_fused_layers == 0


def test_multimodal_per_expert_sharded_input_converts_to_the_same_tensors_and_config(converted, layouts, tmp_path):
    output = tmp_path / "out"
    report = convert(layouts.multimodal, output, max_shard_size="200KB")
    assert report.num_shards > 1 and (output / "model.safetensors.index.json").is_file()
    index = json.loads((output / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {path.name for path in output.glob("*.safetensors")}
    assert_same_tensors(load_checkpoint(output), converted.tensors)
    assert report.num_fused_layers == 4
    assert report.dropped == {"vision": 2, "mtp": 2, "tied lm_head": 0}
    assert report.ignored_config_fields == ["mtp_num_hidden_layers"]
    assert json.loads((output / "config.json").read_text()) == json.loads((converted.dir / "config.json").read_text())


def test_tokenizer_is_copied_and_gets_the_mask_token(qwen, tmp_path):
    """A tokenizer of 240 ordinary + 10 special tokens: `<|mask|>` is appended as id 250, and the mask row is the
    mean of the 240 ordinary rows only."""
    source = shutil.copytree(qwen.dir, tmp_path / "qwen-with-tokenizer")
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(240)}, unk_token="w0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(f"<|special{i}|>", special=True) for i in range(10)])
    tokenizer.save(str(source / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|special1|>"}
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    report = convert(source, tmp_path / "out")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded.convert_tokens_to_ids("<|mask|>") == MASK_ID and loaded.mask_token_id == MASK_ID
    assert loaded("w3 <|mask|> w7")["input_ids"] == [3, MASK_ID, 7]
    assert "added" in report.tokenizer
    embedding = load_checkpoint(tmp_path / "out")["model.embed_tokens.weight"]
    torch.testing.assert_close(embedding[MASK_ID], qwen.state_dict["model.embed_tokens.weight"][:240].mean(0))


# ------------------------------------------------------------------------------------------------ safety


def test_existing_output_without_force_raises_and_is_left_untouched(qwen, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="--force"):
        convert(qwen.dir, output)
    assert [path.name for path in output.iterdir()] == ["keep.txt"]
    assert staged_leftovers(tmp_path) == []


def test_force_replaces_an_existing_output(qwen, converted, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "stale.txt").write_text("old")
    convert(qwen.dir, output, force=True)
    assert not (output / "stale.txt").exists()
    assert_same_tensors(load_checkpoint(output), converted.tensors)
    assert staged_leftovers(tmp_path) == []


def test_truncated_shard_raises_naming_the_file_and_leaves_no_output(layouts, tmp_path):
    source = shutil.copytree(layouts.multimodal, tmp_path / "broken")
    shard = source / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.*truncated or corrupt"):
        convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert staged_leftovers(tmp_path) == []


def test_mask_id_outside_the_vocabulary_raises_before_writing(qwen, tmp_path):
    with pytest.raises(ValueError, match="256 rows.*--mask-token-id"):
        convert_qwen3_5_moe(qwen.dir, tmp_path / "out", mask_token_id=256, progress=False)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_converts_and_prints_the_summary(qwen, converted, tmp_path):
    command = [
        sys.executable, str(REPO / "scripts" / "convert_qwen3_5_moe.py"), "--input", str(qwen.dir),
        "--output", str(tmp_path / "out"), "--dtype", "float32", "--mask-token-id", str(MASK_ID),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"mask embedding: row {MASK_ID} set to the mean of rows [0, {MASK_ID})" in result.stdout
    assert_same_tensors(load_checkpoint(tmp_path / "out"), converted.tensors)
