"""Tests that a saved Clover checkpoint is self-contained remote code: it carries its code files and auto_map, and a
fresh Python process in which the `clover` package cannot be imported loads it through AutoConfig, AutoModel and
AutoModelForCausalLM, generates with it, and saves it again bit-exactly."""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CODE_FILES
from transformers import PreTrainedModel

from clover.modeling_clover import WEIGHT_FILE, CloverForBlockDiffusion

REPO = Path(__file__).resolve().parents[1]
AUTO_MAP = {
    "AutoConfig": "configuration_clover.CloverConfig",
    "AutoModel": "modeling_clover.CloverModel",
    "AutoModelForCausalLM": "modeling_clover.CloverForBlockDiffusion",
}
PROMPT = [[5, 17, 33, 42, 8, 99]]
MAX_NEW_TOKENS = 16  # two blocks of the tiny config's 8

# Runs in a fresh interpreter. `sys.modules["clover"] = None` makes any import of the package fail, so everything
# must come from the checkpoint's own code files.
REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.modules["clover"] = None
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    path, resaved, prompt, max_new_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    package_dir = sys.argv[5]
    saved = load_file(f"{path}/model.safetensors")

    def same(state_dict, prefix=""):
        return sorted(state_dict) == sorted(k[len(prefix):] for k in saved if k.startswith(prefix)) and all(
            torch.equal(tensor, saved[prefix + name]) for name, tensor in state_dict.items()
        )

    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    base = AutoModel.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    model.save_pretrained(resaved)
    reloaded = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True)
    with torch.no_grad():
        generated = model.generate(torch.tensor(prompt), max_new_tokens=max_new_tokens)
    print(json.dumps({
        "classes": {name: [type(obj).__name__, type(obj).__module__] for name, obj in
                    [("AutoConfig", config), ("AutoModel", base), ("AutoModelForCausalLM", model)]},
        "loaded_from_the_package": sorted(  # the package's modules are the .py files at the repository root
            name for name, module in sys.modules.items()
            if os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == package_dir
        ),
        "base_loads_the_saved_weights": same(base.state_dict(), "model."),
        "model_loads_the_saved_weights": same(model.state_dict()),
        "reload_is_bit_exact": same(reloaded.state_dict()) and all(
            torch.equal(tensor, model.state_dict()[name]) for name, tensor in reloaded.state_dict().items()
        ),
        "generated": generated.tolist(),
    }))
    """
)


@pytest.fixture(scope="module")
def saved(tiny_config, tmp_path_factory):
    """A tiny seeded CloverForBlockDiffusion saved with save_pretrained, and the ids it generates in this process."""
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(tiny_config()).float().eval()
    directory = tmp_path_factory.mktemp("remote") / "tiny-clover"
    model.save_pretrained(directory)
    with torch.no_grad():
        generated = model.generate(torch.tensor(PROMPT), max_new_tokens=MAX_NEW_TOKENS)
    return directory, generated.tolist()


@pytest.fixture(scope="module")
def remote(saved, tmp_path_factory):
    """What the fresh process saw (see REMOTE_SCRIPT), and the directory it saved the model into."""
    directory, _ = saved
    work = tmp_path_factory.mktemp("fresh-process")
    resaved = work / "resaved"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(work / "modules")}
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-I", "-c", REMOTE_SCRIPT, str(directory), str(resaved), json.dumps(PROMPT), str(MAX_NEW_TOKENS), str(REPO)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), resaved


def assert_carries_code_and_auto_map(directory: Path) -> None:
    for name in CODE_FILES:
        assert (directory / name).read_bytes() == (REPO / name).read_bytes(), name
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["model_type"] == "clover" and config["architectures"] == ["CloverForBlockDiffusion"]


def test_saved_directory_carries_the_code_files_and_auto_map(saved):
    assert_carries_code_and_auto_map(saved[0])


def test_fresh_process_loads_every_auto_class_from_the_checkpoint_code(remote):
    result, _ = remote
    assert result["loaded_from_the_package"] == []  # every class came from the checkpoint's own files
    expected = {"AutoConfig": "CloverConfig", "AutoModel": "CloverModel", "AutoModelForCausalLM": "CloverForBlockDiffusion"}  # fmt: skip
    for auto_class, (class_name, module) in result["classes"].items():
        assert class_name == expected[auto_class]
        assert module.startswith("transformers_modules."), module


def test_remote_models_hold_exactly_the_saved_weights(remote):
    result, _ = remote
    assert result["base_loads_the_saved_weights"]
    assert result["model_loads_the_saved_weights"]


def test_remote_model_saved_again_reloads_bit_exactly_with_code_and_auto_map(remote):
    result, resaved = remote
    assert result["reload_is_bit_exact"]
    assert_carries_code_and_auto_map(resaved)


def test_remote_model_generates_what_the_package_model_generates(saved, remote):
    _, expected = saved
    result, _ = remote
    assert len(result["generated"][0]) == len(PROMPT[0]) + MAX_NEW_TOKENS
    assert result["generated"] == expected


def _package_imports(path: Path) -> dict[str, set[str]]:
    """The package modules a file imports (relative imports), each with the names it takes from it."""
    imports: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            imports.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return imports


def test_the_carried_files_import_only_each_other_and_the_model_only_the_mixin_from_generation():
    """DESIGN.md §0: a checkpoint's code files run without the package; the model inherits `generate` from
    `CloverGenerationMixin` and takes nothing else from generation, which never imports modeling (no cycle)."""
    carried = {name.removesuffix(".py") for name in CODE_FILES}
    imports = {name.removesuffix(".py"): _package_imports(REPO / name) for name in CODE_FILES}
    for module, imported in imports.items():
        assert set(imported) <= carried, (module, sorted(set(imported) - carried))
    assert imports["modeling_clover"]["generation_clover"] == {"CloverGenerationMixin"}
    assert "modeling_clover" not in imports["generation_clover"]


def _weight_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if WEIGHT_FILE.fullmatch(path.name))


def _assert_holds(directory: Path, model) -> None:
    reloaded = CloverForBlockDiffusion.from_pretrained(directory)
    for (name, expected), (_, loaded) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(expected, loaded), name


def test_a_save_over_another_checkpoint_leaves_only_its_own_weight_files(tiny_config, tmp_path):
    """A sharded save over a single-file checkpoint (and back): transformers leaves the other layout's files, and
    from_pretrained then prefers model.safetensors, i.e. the old weights."""
    torch.manual_seed(0)
    single, sharded = CloverForBlockDiffusion(tiny_config()), CloverForBlockDiffusion(tiny_config())
    single.save_pretrained(tmp_path)
    sharded.save_pretrained(tmp_path, max_shard_size="200KB")
    files = _weight_files(tmp_path)
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files and len(files) > 2
    _assert_holds(tmp_path, sharded)
    single.save_pretrained(tmp_path)
    assert _weight_files(tmp_path) == ["model.safetensors"]
    _assert_holds(tmp_path, single)
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]  # nothing set aside is left


def test_a_failed_save_puts_the_previous_weights_back(tiny_config, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(tiny_config())
    model.save_pretrained(tmp_path)

    def failing_save(self, save_directory, *args, **kwargs):
        (Path(save_directory) / "model.safetensors").write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", failing_save)
    with pytest.raises(OSError, match="disk full"):
        CloverForBlockDiffusion(tiny_config()).save_pretrained(tmp_path, max_shard_size="200KB")
    monkeypatch.undo()
    assert _weight_files(tmp_path) == ["model.safetensors"]
    _assert_holds(tmp_path, model)


def test_a_truncated_weight_file_is_named_with_its_path(tiny_config, tmp_path):
    CloverForBlockDiffusion(tiny_config()).save_pretrained(tmp_path, max_shard_size="200KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # an interrupted download
    with pytest.raises(OSError, match=rf"{re.escape(str(shard))} is not a readable safetensors file .* again"):
        CloverForBlockDiffusion.from_pretrained(tmp_path)
