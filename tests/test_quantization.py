"""bitsandbytes quantization on CPU: `from_pretrained(quantization_config=...)` converts the nn.Linear layers
(transformers) and the fused 3D experts as they load (Clover); `quantize_experts` converts the experts of a model
in memory; a quantized model saves a pre-quantized checkpoint. Memory is checked against memory_clover's arithmetic to the byte,
and the logits against the unquantized model. Tiny bf16 model; skipped without bitsandbytes."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from clover.memory_clover import measured_weight_bytes, weight_bytes
from clover.modeling_clover import CloverForBlockDiffusion
from clover.quantization_clover import (
    UNQUANTIZED_MODULES,
    CloverInt8Dequantize,
    fused_expert_modules,
    quantize_experts,
    quantize_tensor,
    with_unquantized_gates,
)
from clover.training_clover import CloverDataCollator

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes' fp16 cast notes on CPU

# Relative RMS error of the logits against the bf16 model (tiny random model, 4 layers). Measured: experts only
# nf4 0.033, int8 0.014; everything quantized nf4 0.21 (nf4 is ~9% RMS error per weight, compounding through every
# projection of an untrained model), int8 0.026.
EXPERTS_ONLY_BOUND = {"nf4": 0.06, "int8": 0.03}
WHOLE_MODEL_BOUND = {"nf4": 0.35, "int8": 0.05}


def relative_drift(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits.float() - reference.float()).norm() / reference.float().norm())


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.fixture(scope="module")
def checkpoint(tiny_config, tmp_path_factory):
    """(bf16 model in memory, its checkpoint). Shared expert width 64: a multiple of 32 for the CPU 4-bit kernel."""
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(tiny_config(shared_expert_intermediate_size=64)).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("tiny-bf16")
    model.save_pretrained(path)
    return model, path


QUANT_TYPES = ["nf4", "fp4-double", "int8"]  # fp4-double: fp4 with double-quantized statistics


def load_quantized(path, quant_type: str, skip: list[str] | None = None):
    """from_pretrained with a bitsandbytes config: "nf4", "fp4-double" (4-bit) or "int8" (8-bit); `skip` is
    `llm_int8_skip_modules` as a user writes it (None: transformers' default)."""
    skip_modules = None if skip is None else ["lm_head", *skip]
    if quant_type == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type.split("-")[0],
            bnb_4bit_use_double_quant=quant_type.endswith("-double"),
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=skip_modules,
        )
    return AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=torch.bfloat16, quantization_config=config
    )


def test_bitsandbytes_config_quantizes_the_experts_as_they_load(checkpoint):
    model = load_quantized(checkpoint[1], "nf4")
    assert type(model.model.layers[0].mlp.shared_expert.up_proj).__name__ == "Linear4bit"
    for _, experts in fused_expert_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            assert experts.parametrizations[name].original.dtype == torch.uint8
            assert getattr(experts, name).dtype == torch.bfloat16  # what the forward reads: dequantized
    assert model.config.experts_quantization == {"quant_type": "nf4", "blocksize": 64, "double_quant": False}


@pytest.mark.parametrize("skip", [None, ["experts"]])
def test_routers_and_gates_stay_16bit_and_a_4bit_model_runs_in_eval_mode(checkpoint, skip):
    """bitsandbytes' CPU kernel repacks Linear4bit layers in 32-row tiles in eval mode and asserts on narrower
    ones (the gates: 1 and 4 rows here). The user's skip list is extended, never replaced."""
    model = load_quantized(checkpoint[1], "nf4", skip=skip).eval()
    layers = model.model.layers
    for gate in (layers[0].linear_attn.in_proj_a, layers[0].linear_attn.in_proj_b, layers[0].mlp.shared_expert_gate):
        assert type(gate) is nn.Linear and gate.weight.dtype == torch.bfloat16
    assert type(layers[0].linear_attn.in_proj_qkv).__name__ == "Linear4bit"
    assert type(model.lm_head) is nn.Linear
    assert 6 < model.generate(random_ids(1, 6), max_new_tokens=8).shape[1] <= 14


def test_with_unquantized_gates_extends_a_copy_of_a_bitsandbytes_config():
    user = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["experts"])
    extended = with_unquantized_gates(user)
    assert extended.llm_int8_skip_modules == ["experts", *UNQUANTIZED_MODULES]
    assert user.llm_int8_skip_modules == ["experts"]  # the caller's object is left alone
    as_dict = with_unquantized_gates({"quant_method": "bitsandbytes", "load_in_8bit": True})
    assert as_dict["llm_int8_skip_modules"] == [
        "lm_head",
        *UNQUANTIZED_MODULES,
    ]  # none given: transformers' default too
    other = {"quant_method": "gptq", "bits": 4}
    assert with_unquantized_gates(other) is other


def test_a_4bit_model_saved_after_generating_reloads_to_the_same_logits(checkpoint, tmp_path):
    """In eval mode on CPUs with AVX512-BF16 bitsandbytes repacks each Linear4bit at its first forward, and its own
    inverse (run by state_dict) leaves the statistics scrambled: the live model and its save then compute garbage."""
    model = load_quantized(checkpoint[1], "nf4").eval()
    ids = random_ids(2, 24)
    before = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(logits_of(model, ids), before, rtol=0, atol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.bfloat16).eval()
    torch.testing.assert_close(logits_of(reloaded, ids), before, rtol=0, atol=0)


def test_experts_in_skip_modules_stay_16bit(checkpoint):
    model = load_quantized(checkpoint[1], "nf4", skip=["experts"])
    for _, experts in fused_expert_modules(model):
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.bfloat16
        assert not hasattr(experts, "parametrizations")


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_quantizing_at_load_equals_quantizing_after_it(checkpoint, quant_type):
    at_load = load_quantized(checkpoint[1], quant_type)
    after = load_quantized(checkpoint[1], quant_type, skip=["experts"])
    quantize_experts(
        after, "fp4" if quant_type == "fp4-double" else quant_type, compress_statistics="double" in quant_type
    )
    ids = random_ids(2, 24)
    torch.testing.assert_close(logits_of(at_load, ids), logits_of(after, ids), rtol=0, atol=0)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_quantized_model_saves_a_pre_quantized_checkpoint(checkpoint, quant_type, tmp_path):
    model = load_quantized(checkpoint[1], quant_type)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["experts_quantization"] == model.config.experts_quantization
    file_bytes = (tmp_path / "model.safetensors").stat().st_size
    assert file_bytes < 1.05 * measured_weight_bytes(model) + 64_000  # the quantized size, plus the safetensors header
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.bfloat16)
    for (_, a), (_, b) in zip(fused_expert_modules(model), fused_expert_modules(reloaded), strict=True):
        for name in ("gate_up_proj", "down_proj"):  # loaded as stored, not quantized again from 16-bit
            assert torch.equal(a.parametrizations[name].original, b.parametrizations[name].original)
            for key, buffer in a.parametrizations[name][0].named_buffers():
                assert buffer.dtype == torch.float32 or buffer.dtype == torch.uint8, key
                assert torch.equal(buffer, b.parametrizations[name][0].get_buffer(key)), key
    ids = random_ids(2, 24)
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(model, ids), rtol=0, atol=0)
    prompt = random_ids(1, 10)
    assert torch.equal(
        reloaded.generate(prompt, max_new_tokens=12, do_sample=False),
        model.generate(prompt, max_new_tokens=12, do_sample=False),
    )


def test_a_partly_quantized_model_refuses_to_save(checkpoint, tmp_path):
    model = copy.deepcopy(checkpoint[0])
    experts = fused_expert_modules(model)[0][1]
    quantize_tensor(experts, "gate_up_proj", {"quant_type": "int8", "blocksize": None, "double_quant": False})
    with pytest.raises(ValueError, match="more than one format"):
        model.save_pretrained(tmp_path)


def test_qlora_trains_adapters_on_a_4bit_model(checkpoint):
    peft = pytest.importorskip("peft")
    model = load_quantized(checkpoint[1], "nf4")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"]))
    model.train()
    prompts, answers = random_ids(2, 10), random_ids(2, 12, seed=1)
    features = [{"prompt_ids": p.tolist(), "answer_ids": a.tolist()} for p, a in zip(prompts, answers, strict=True)]
    batch = CloverDataCollator(model.config.pad_token_id, model.config.block_size, seed=0)(features)
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if "lora_B" in name]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    assert not any(p.requires_grad for name, p in model.named_parameters() if "experts" in name)


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_quantize_experts_after_a_bitsandbytes_load(checkpoint, quant_type):
    reference, path = checkpoint
    model = load_quantized(path, quant_type, skip=["experts"])
    config = model.config

    def predicted(**options):
        return sum(weight_bytes(config, torch.bfloat16, quant_type, **options).values())

    linears_only = measured_weight_bytes(model)
    assert linears_only == predicted(quantize_experts=False)

    assert quantize_experts(model, quant_type) == 2 * config.num_hidden_layers
    storage = {"nf4": torch.uint8, "int8": torch.int8}[quant_type]
    for _, experts in fused_expert_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            assert experts.parametrizations[name].original.dtype == storage
            assert getattr(experts, name).dtype == torch.bfloat16  # what the forward reads: dequantized
    # measured before the first forward: bitsandbytes' CPU kernels repack the Linear4bit/Int8 weights on first use
    quantized = measured_weight_bytes(model)
    assert quantized == predicted()
    assert quantized < linears_only < measured_weight_bytes(reference)

    ids = random_ids(2, 24)
    assert relative_drift(logits_of(model, ids), logits_of(reference, ids)) < WHOLE_MODEL_BOUND[quant_type]
    prompt = random_ids(1, 10)
    output = model.generate(prompt, max_new_tokens=16, do_sample=False)
    new_tokens = output[0, 10:]
    assert 10 < output.shape[1] <= 26 and torch.equal(output[0, :10], prompt[0])  # shorter if EOS came
    assert bool(((new_tokens >= 0) & (new_tokens < config.vocab_size) & (new_tokens != config.mask_token_id)).all())


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_quantized_experts_alone_stay_close_to_the_model(checkpoint, quant_type):
    reference = checkpoint[0]
    model = copy.deepcopy(reference)
    quantize_experts(model, quant_type)
    ids = random_ids(2, 24)
    assert relative_drift(logits_of(model, ids), logits_of(reference, ids)) < EXPERTS_ONLY_BOUND[quant_type]


def test_quantize_experts_skips_tensors_already_quantized(checkpoint):
    model = copy.deepcopy(checkpoint[0])
    assert quantize_experts(model, "int8") == 8
    assert quantize_experts(model, "int8") == 0


def test_int8_experts_use_one_absmax_per_row():
    experts = nn.Module()
    # expert 0, row 0: absmax 2 -> 1 * 127 / 2 = 63.5 rounds to 64, 0.5 * 63.5 = 31.75 rounds to 32
    experts.gate_up_proj = nn.Parameter(torch.tensor([[[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]]))
    experts.down_proj = nn.Parameter(torch.tensor([[[4.0, 4.0, -4.0]]]))
    quantize_experts(experts, "int8")
    assert experts.parametrizations.gate_up_proj.original.tolist() == [[[64, -127, 32], [0, 0, 0]]]
    assert experts.parametrizations.down_proj.original.tolist() == [[[127, 127, -127]]]
    assert isinstance(experts.parametrizations.gate_up_proj[0], CloverInt8Dequantize)
    expected = torch.tensor([[[64 * 2 / 127, -2.0, 32 * 2 / 127], [0.0, 0.0, 0.0]]])  # int8 * absmax / 127
    torch.testing.assert_close(experts.gate_up_proj, expected)
    torch.testing.assert_close(experts.down_proj, torch.tensor([[[4.0, 4.0, -4.0]]]))


def test_quantize_experts_rejects_bad_input():
    with pytest.raises(ValueError, match="quant_type"):
        quantize_experts(nn.Linear(4, 4), "int4")
    with pytest.raises(ValueError, match="no fused experts"):
        quantize_experts(nn.Linear(4, 4), "nf4")


PEAK_OF_A_LOAD = """
import gc, json, sys, threading, time, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from clover.memory_clover import measured_weight_bytes
from clover.quantization_clover import fused_expert_modules

def anonymous_bytes():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

def load():
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16,
                                                quantization_config=config)

warm = load()  # the first load also initialises bitsandbytes and imports the remote code: not the model's memory
del warm
gc.collect()
start = anonymous_bytes()
peak, done = [start], []

def watch():
    while not done:
        peak[0] = max(peak[0], anonymous_bytes())
        time.sleep(0.0002)

watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
model = load()
done.append(True)
watcher.join()
experts = [m for _, m in fused_expert_modules(model)]
expert_bytes = sum(t.numel() * t.element_size() for m in experts for t in [*m.parameters(), *m.buffers()])
print(json.dumps({"peak": peak[0] - start, "weights": measured_weight_bytes(model), "expert_bytes": expert_bytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc (Linux)")
def test_a_4bit_load_peaks_at_the_quantized_model_plus_one_layer(tiny_config, tmp_path):
    """64 experts of 256 x 256: 25 MB of bf16 experts per layer, 100 MB in all. The peak of the load's anonymous
    memory (the 16-bit tensors are read through the file's memory map) stays within the quantized model plus one
    layer's 16-bit experts, and the experts end at <= 30% of their bf16 bytes."""
    torch.manual_seed(0)
    config = tiny_config(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=64,
                         num_experts=64, num_experts_per_tok=8)  # fmt: skip
    model = CloverForBlockDiffusion(config).to(torch.bfloat16)
    bf16_expert_bytes = sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for _, m in fused_expert_modules(model))
    one_layer = bf16_expert_bytes // config.num_hidden_layers
    model.save_pretrained(tmp_path)
    del model
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed memory goes back at once
    result = subprocess.run(
        [sys.executable, "-c", PEAK_OF_A_LOAD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["expert_bytes"] <= 0.30 * bf16_expert_bytes
    assert measured["peak"] <= measured["weights"] + one_layer, measured
