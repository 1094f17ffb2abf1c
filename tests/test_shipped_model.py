"""The shipped tiny Clover: it loads as remote code, carries the package's current code, and works through the
entry points users have (pipelines, scripts/generate.py, scripts/train.py with LoRA)."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CODE_FILES
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from clover.demo.evaluation import evaluate, summarise
from clover.demo.tasks import FAMILIES, generate_examples

REPO = Path(__file__).resolve().parents[1]
SHIPPED = Path(os.environ.get("CLOVER_DEMO_MODEL", REPO / "models" / "clover-tiny-demo"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(SHIPPED, trust_remote_code=True).eval()


def _chat_ids(tokenizer, text: str, thinking: bool = False) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=thinking, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_shipped_model_carries_the_current_code_files():
    # A checkpoint loads its own copy of the code: it must be the package's, or users run stale code.
    for name in CODE_FILES:
        assert filecmp.cmp(SHIPPED / name, REPO / name, shallow=False), (
            f"{name} differs: run scripts/sync_model_code.py"
        )
    config = json.loads((SHIPPED / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}


def test_shipped_model_loads_as_remote_code_and_is_small(model):
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert type(model).__name__ == "CloverForBlockDiffusion"
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) < 32 * 2**20
    assert type(model.generation_config).__name__ == "CloverGenerationConfig"
    assert model.generation_config.threshold == 0.95


HELD_OUT_SEED = 12345  # eval_demo.py's held-out problems: no training corpus uses this seed
TARGET_EXACT_MATCH = 0.9  # in every family, at the default threshold (0.95)


def held_out_result(model, tokenizer, per_family: int) -> dict:
    """eval_demo.py's evaluation at 0.95 on its first `per_family` held-out problems of each family."""
    examples = generate_examples(per_family * len(FAMILIES), seed=HELD_OUT_SEED)
    stats = evaluate(model, tokenizer, examples, decoding=0.95, batch_size=20, max_new_tokens=192)
    return summarise(stats)  # greedy, deterministic: a padded batch decodes as its rows alone


def test_shipped_model_still_answers_most_held_out_problems_in_parallel(model, tokenizer):
    """A cheap guard on 32 problems: the shipped weights answer most of them (28 of 32 measured, 7.8 tokens per
    forward); a decoding regression drops this at once."""
    result = held_out_result(model, tokenizer, per_family=8)
    assert result["accuracy"]["all"] >= 0.8, result["accuracy"]
    assert result["tokens_per_forward"] >= 3, result["tokens_per_forward"]


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,  # the targets missed, not the evaluation broken
    reason="the shipped demo model does not reach the targets yet: on eval_demo's 400 held-out problems at 0.95 "
    "88.2% exact match (addition 88%, sorting 84%, reversal 85%, tool calls 96%); remove this marker once a "
    "retrained model reaches them",
)
def test_shipped_model_answers_held_out_problems_right_at_three_tokens_per_forward(model, tokenizer):
    result = held_out_result(model, tokenizer, per_family=50)
    accuracy = {family: result["accuracy"][family] for family in FAMILIES}
    assert min(accuracy.values()) >= TARGET_EXACT_MATCH, accuracy
    assert result["tokens_per_forward"] >= 3, result["tokens_per_forward"]


def test_decoding_is_the_recorded_one(model):
    # tests/fixtures/shipped_decoding.json holds what this checkpoint decoded when it was recorded (thresholds 1.0,
    # 0.95 and 0.7, a padded batch, fused and unfused commits): the decode path may be reorganised, never changed.
    record = json.loads((REPO / "tests" / "fixtures" / "shipped_decoding.json").read_text())
    assert record["checkpoint_sha256"] == hashlib.sha256((SHIPPED / "model.safetensors").read_bytes()).hexdigest(), (
        "the shipped model changed: rerun tests/fixtures/record_shipped_decoding.py"
    )
    batch = {key: torch.tensor(record[key]) for key in ("input_ids", "attention_mask")}
    for case in record["results"]:
        settings = {key: case[key] for key in ("threshold", "fuse_commit", "max_new_tokens")}
        out = model.generate(**batch, do_sample=False, return_dict_in_generate=True, **settings)
        assert out.sequences.tolist() == case["sequences"], settings
        assert out.num_forward_passes.tolist() == case["forwards"], settings


def test_pipeline_plain_prompt_matches_generate_and_full_text(model, tokenizer):
    generator = pipeline("text-generation", model=str(SHIPPED), trust_remote_code=True)
    ids = _chat_ids(tokenizer, "Reverse the words: apple river stone")
    prompt = tokenizer.decode(ids)
    full = generator(prompt, max_new_tokens=32)[0]["generated_text"]
    new = generator(prompt, max_new_tokens=32, return_full_text=False)[0]["generated_text"]
    assert full == prompt + new
    # The pipeline is greedy (the generation config says so) and decodes what model.generate decodes.
    reference = model.generate(torch.tensor([ids]), max_new_tokens=32)[0, len(ids) :]
    # A tokenizer with a response template keeps the special tokens in the pipeline's text (transformers 5.25).
    keeps_special = getattr(generator.tokenizer, "response_template", None) is not None
    assert new == tokenizer.decode(reference, skip_special_tokens=not keeps_special)


def test_pipeline_chat_messages_batched_equal_one_by_one():
    generator = pipeline("text-generation", model=str(SHIPPED), trust_remote_code=True)
    chats = [
        [{"role": "user", "content": "Sort these numbers: 5, 3, 9, 1, 7"}],
        [{"role": "user", "content": "What is 123 + 456?"}],
        [{"role": "user", "content": "Reverse: red green blue"}],
    ]
    batched = generator(chats, max_new_tokens=48, batch_size=3, return_full_text=False)
    single = [generator(chat, max_new_tokens=48, return_full_text=False) for chat in chats]
    # A batched row is padded after its EOS (as in autoregressive generate), and with a response template
    # (transformers 5.25) the pipeline's text keeps those pad tokens.
    pads = f"({re.escape(generator.tokenizer.pad_token)})+$"
    unpadded = [re.sub(pads, "", b[0]["generated_text"]) for b in batched]
    assert unpadded == [s[0]["generated_text"] for s in single]
    assert all(b[0]["generated_text"] for b in batched)
    full = generator(chats[0], max_new_tokens=48)[0]["generated_text"]
    assert full[:-1] == chats[0] and full[-1]["role"] == "assistant"


def test_generate_script_streams_and_reports_speed():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate.py"), "--model", str(SHIPPED), "What is 250 + 250?"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[thinking]" in result.stdout, result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert "new tokens" in last and "tokens/forward" in last and "tok/s" in last, last


BASE = REPO / "models" / "qwen3_5_moe-tiny-demo"


def test_shipped_base_is_a_plain_qwen3_5_moe_checkpoint():
    """The AR base Clover was converted from: transformers' own class, no remote code, Clover's layer layout."""
    from transformers import Qwen3_5MoeForCausalLM

    base = AutoModelForCausalLM.from_pretrained(BASE)
    assert type(base) is Qwen3_5MoeForCausalLM
    assert not any(path.suffix == ".py" for path in BASE.iterdir())
    assert sum(f.stat().st_size for f in BASE.iterdir()) < 32 * 2**20
    clover = json.loads((SHIPPED / "config.json").read_text())
    assert base.config.layer_types == clover["layer_types"]
    assert base.config.hidden_size == clover["hidden_size"] and base.config.vocab_size == clover["vocab_size"]
