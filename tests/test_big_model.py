"""Big-model readiness: the memory arithmetic against a real tiny model, device_map offloading (cpu/disk), the peak
memory of from_pretrained, and the tensor-parallel plan. Tiny configs on CPU; the torchrun check is marked slow."""

import os
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from clover.configuration_clover import CloverConfig
from clover.memory_clover import (
    cache_bytes,
    estimate_memory,
    measured_cache_bytes,
    measured_weight_bytes,
    parameter_counts,
    parameter_specs,
    weight_bytes,
)
from clover.modeling_clover import CloverCache, CloverForBlockDiffusion

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16  # two blocks of 8


# ------------------------------------------------------------------------------------------------ memory arithmetic


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"attention_bias": True}])
def test_parameter_specs_name_every_parameter_with_its_shape(tiny_config, overrides):
    config = tiny_config(**overrides)
    model = CloverForBlockDiffusion(config)
    specs = parameter_specs(config)
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_equal_the_bytes_of_the_parameters(tiny_config, dtype):
    config = tiny_config()
    model = CloverForBlockDiffusion(config).to(dtype)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(weight_bytes(config, dtype).values()) == expected == measured_weight_bytes(model)
    assert sum(parameter_counts(config).values()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_equal_the_committed_cache_after_prefill(tiny_config, dtype):
    config = tiny_config()
    model = CloverForBlockDiffusion(config).to(dtype).eval()
    batch_size, num_tokens = 3, 37
    cache = CloverCache(config)
    with torch.no_grad():
        model.model(input_ids=random_ids(batch_size, num_tokens), past_key_values=cache, use_cache=True)
    # the recurrent state is fp32 whatever the model dtype; keys, values and the conv window follow the model
    assert {t.dtype for t in cache.recurrent_states if t is not None} == {torch.float32}
    assert measured_cache_bytes(cache) == cache_bytes(config, dtype).total(num_tokens, batch_size)


def test_cache_holds_no_more_memory_than_its_committed_tensors(tiny_config):
    config = tiny_config()
    model = CloverForBlockDiffusion(config).eval()
    cache = CloverCache(config)
    with torch.no_grad():
        model.model(input_ids=random_ids(2, 100), past_key_values=cache, use_cache=True)
    states = [t for t in cache.conv_states + cache.recurrent_states if t is not None]
    assert [t.untyped_storage().nbytes() for t in states] == [t.numel() * t.element_size() for t in states]


def test_35b_figures():
    """The shape of the release: ~35B parameters, ~69 GB in bf16, 93% of it in the routed experts."""
    config = CloverConfig()
    counts = parameter_counts(config)
    bf16 = weight_bytes(config, torch.bfloat16)
    assert sum(counts.values()) == 34_660_610_688
    assert sum(bf16.values()) == 69_321_221_376
    assert 0.92 < bf16["experts"] / sum(bf16.values()) < 0.94
    cache = cache_bytes(config, torch.bfloat16)
    assert cache.attention_per_token == 10 * 2 * 2 * 256 * 2  # 10 full layers x (k, v) x 2 heads x 256 x bf16
    assert cache.recurrent_per_sequence == 30 * 32 * 128 * 128 * 4  # 30 GDN layers x 32 heads x 128 x 128 x fp32
    assert cache.conv_per_sequence == 30 * (2 * 2048 + 4096) * 3 * 2  # 30 layers x conv_dim x (kernel - 1) x bf16
    # nf4 keeps the embeddings and lm_head in bf16 (~2 GB): the 35B model does not fit 16 GB even in 4 bits.
    nf4 = sum(weight_bytes(config, torch.bfloat16, "nf4").values())
    assert 20e9 < nf4 < 22e9
    assert "141 GB (H200)" in estimate_memory(config, 131072).fitting_gpus()


def test_memory_script_prints_the_table_and_the_fitting_cards(capsys):
    main = runpy.run_path(str(REPO / "scripts" / "memory.py"), run_name="memory")["main"]
    main(["--quantization", "int8", "--context", "32768", "--batch", "2"])
    out = capsys.readouterr().out
    assert "experts" in out and "32,212,254,720" in out
    assert "fits on: 48 GB" in out


# ------------------------------------------------------------------------------------------------ device_map


@pytest.fixture(scope="module")
def saved_tiny(tiny_config, tmp_path_factory):
    """(in-memory model, checkpoint directory) of one seeded tiny model (vocab 128, 4 layers, ~1.4 MB)."""
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(tiny_config()).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return model, path


def greedy(model, prompt):
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_device_map_auto_without_limits_generates_like_the_model_in_memory(saved_tiny):
    model, path = saved_tiny
    loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, device_map="auto")
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    prompt = random_ids(1, 10)
    assert torch.equal(greedy(loaded, prompt), greedy(model, prompt))


def test_disk_offload_generates_like_the_model_in_memory(saved_tiny, tmp_path):
    model, path = saved_tiny
    device_map = {
        "model.embed_tokens": "disk",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",  # Gated DeltaNet
        "model.layers.2": "cpu",
        "model.layers.3": "disk",  # full attention
        "model.norm": "cpu",
        "lm_head": "disk",
    }
    loaded = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, device_map=device_map, offload_folder=tmp_path
    )
    assert loaded.hf_device_map == device_map
    assert loaded.model.layers[1].linear_attn.conv1d.weight.device.type == "meta"  # really offloaded
    prompt = random_ids(2, 10)
    assert torch.equal(greedy(loaded, prompt), greedy(model, prompt))


def test_device_map_auto_offloads_to_disk_under_a_memory_limit(saved_tiny, tmp_path):
    model, path = saved_tiny
    loaded = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, device_map="auto", max_memory={"cpu": 600_000}, offload_folder=tmp_path
    )
    assert "disk" in loaded.hf_device_map.values()
    prompt = random_ids(1, 10)
    assert torch.equal(greedy(loaded, prompt), greedy(model, prompt))


# ------------------------------------------------------------------------------------------------ load memory

LOAD_AND_MEASURE = textwrap.dedent(
    """
    import os, re, sys
    import torch
    from clover.modeling_clover import CloverForBlockDiffusion

    def peak_rss():
        # VmHWM, not ru_maxrss: a child process inherits its parent's ru_maxrss across fork and exec.
        with open("/proc/self/status") as status:
            return int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1)) * 1024

    before = peak_rss()
    model = CloverForBlockDiffusion.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
    for p in model.parameters():  # touch one value per page: lazily mapped weights count once read
        p.detach().reshape(-1)[::512].float().sum()
    print((peak_rss() - before) / os.path.getsize(os.path.join(sys.argv[1], "model.safetensors")))
    """
)


# 4 wide layers, 48 experts of width 512: ~157M parameters, a ~314 MB bf16 checkpoint
WIDE_FIELDS = dict(
    vocab_size=512,
    hidden_size=512,
    num_attention_heads=4,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=48,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from Linux's /proc")
def test_from_pretrained_holds_the_weights_once(tiny_config, tmp_path):
    """A bf16 checkpoint of ~310 MB loaded in bf16 raises the peak RSS by ~1x its size (measured 1.03), not 2x."""
    config = tiny_config(**WIDE_FIELDS)
    state = {s.name: torch.full(s.shape, 0.01, dtype=torch.bfloat16) for s in parameter_specs(config)}
    assert sum(t.numel() * 2 for t in state.values()) > 300e6
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    del state
    config.save_pretrained(tmp_path)
    command = [sys.executable, "-c", LOAD_AND_MEASURE, str(tmp_path), "bfloat16"]
    result = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ratio = float(result.stdout.strip().splitlines()[-1])
    assert 0.9 < ratio < 1.5, f"peak RSS grew by {ratio:.2f}x the checkpoint size"


# ------------------------------------------------------------------------------------------------ tensor parallel


def full_tp_plan(model) -> dict[str, str]:
    plan = {f"model.{key}": style for key, style in model.config.base_model_tp_plan.items()}
    return {**plan, **type(model)._tp_plan}


def matching_names(pattern: str, names) -> list[str]:
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
    return [name for name in names if regex.match(name)]


def test_tp_plan_styles_are_known_to_the_installed_transformers(tiny_model):
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    unknown = sorted({style for style in full_tp_plan(tiny_model).values() if style not in ALL_PARALLEL_STYLES})
    assert unknown == []


def test_tp_plan_entries_name_tensors_that_split_evenly_in_two(tiny_model):
    """Every plan entry names parameters or modules of the model, and what it shards splits into 2 equal halves
    that keep attention heads (and each packed half of gate_up_proj) whole."""
    config = tiny_model.config
    parameters = dict(tiny_model.named_parameters())
    modules = dict(tiny_model.named_modules())
    output_dim_styles = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise", "packed_colwise"}
    input_dim_styles = {"rowwise", "rowwise_split_input", "packed_rowwise", "local_packed_rowwise"}
    for pattern, style in full_tp_plan(tiny_model).items():
        names = matching_names(pattern, parameters) or matching_names(pattern, modules)
        assert names, f"plan entry {pattern!r} matches nothing"
        for name in names:
            tensor = parameters.get(name)
            if tensor is None:
                tensor = getattr(modules[name], "weight", None)
            if tensor is None or style not in output_dim_styles | input_dim_styles:
                continue  # a module-level style (e.g. the experts' all-reduce)
            dim = -2 if style in output_dim_styles else -1
            halves = 2 if name.endswith("gate_up_proj") else 1  # gate and up are packed: each half splits
            assert tensor.shape[dim] % (2 * halves) == 0, f"{name} {tuple(tensor.shape)} ({style})"
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0


TP_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, tp_plan="auto")
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    if int(os.environ["RANK"]) == 0:
        torch.save(logits, sys.argv[3])
    """
)


@pytest.mark.slow
def test_tensor_parallel_on_two_cpu_processes_matches_one(saved_tiny, tmp_path):
    model, path = saved_tiny
    ids = random_ids(2, 12)
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "tp.py").write_text(TP_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(tmp_path / "tp.py")]
    args = [str(path), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")]
    result = subprocess.run(command + args, capture_output=True, text=True, env=ONE_THREAD, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)
