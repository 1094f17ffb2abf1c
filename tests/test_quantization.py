"""bitsandbytes quantization on CPU: `from_pretrained(quantization_config=...)` converts only nn.Linear, and
`quantize_experts` converts the fused 3D experts. Memory is checked against memory_clover's arithmetic to the byte,
and the logits against the unquantized model. Tiny bf16 model; skipped without bitsandbytes."""

import copy

import pytest
import torch
from conftest import random_ids
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from clover.memory_clover import measured_weight_bytes, weight_bytes
from clover.modeling_clover import CloverForBlockDiffusion
from clover.quantization_clover import CloverInt8Dequantize, fused_expert_modules, quantize_experts

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes' fp16 cast notes on CPU

# bitsandbytes' CPU 4-bit kernel (its AVX512-BF16 path) repacks weights in groups of 32 output rows and asserts on
# narrower layers: shared_expert_gate (1 row, in the 35B model too) and the tiny in_proj_a/b (4 rows) stay 16-bit.
SKIP_MODULES = ["lm_head", "shared_expert_gate", "in_proj_a", "in_proj_b"]
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


def load_quantized(path, quant_type: str):
    if quant_type == "nf4":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=SKIP_MODULES,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=SKIP_MODULES)
    return AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=torch.bfloat16, quantization_config=config
    )


def test_bitsandbytes_config_alone_leaves_the_experts_in_16bit(checkpoint):
    model = load_quantized(checkpoint[1], "nf4")
    assert type(model.model.layers[0].mlp.shared_expert.up_proj).__name__ == "Linear4bit"
    for _, experts in fused_expert_modules(model):
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.bfloat16


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_quantize_experts_after_a_bitsandbytes_load(checkpoint, quant_type):
    reference, path = checkpoint
    model = load_quantized(path, quant_type)
    config = model.config

    def predicted(**options):
        return sum(weight_bytes(config, torch.bfloat16, quant_type, skip_modules=SKIP_MODULES, **options).values())

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
    assert output.shape == (1, 26) and torch.equal(output[0, :10], prompt[0])
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
