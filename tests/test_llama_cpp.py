"""Clover on llama.cpp: the GGUF export (layout, metadata, bad inputs, no half-written file), llama.cpp's forwards
against transformers' (causal logits, a denoising step), decoding (the same tokens as `generate` on held-out demo
problems, at 0.95 and self-speculatively), sampling's rule, scripts/generate.py --gguf, and llama.cpp's
OpenAI-compatible server streaming a chat completion of an exported Clover."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llama extra is not installed: pip install -e '.[llama]'")
gguf = pytest.importorskip("gguf", reason="the llama extra is not installed: pip install -e '.[llama]'")

from conftest import run_python  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from clover import gguf_clover  # noqa: E402
from clover.demo.evaluation_llama_cpp import (  # noqa: E402
    agreement,
    decode_llama_cpp,
    decode_transformers,
    prompt_ids,
    score,
)
from clover.demo.tasks import generate_examples  # noqa: E402
from clover.gguf_clover import export_gguf, read_clover_metadata  # noqa: E402
from clover.llama_cpp_clover import LlamaCppClover  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "clover-tiny-demo"
AR_BASE = REPO / "models" / "qwen3_5_moe-tiny-demo"
HELD_OUT_SEED = 12345  # eval_demo.py's held-out problems


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return export_gguf(SHIPPED, tmp_path_factory.mktemp("gguf") / "clover.f32.gguf", "f32")


@pytest.fixture(scope="module")
def llama(exported) -> LlamaCppClover:
    model = LlamaCppClover(exported, n_ctx=2048, n_threads=1)
    yield model
    model.close()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(SHIPPED, trust_remote_code=True).eval()


def _prompt(tokenizer, index: int = 0) -> list[int]:
    return prompt_ids(tokenizer, generate_examples(index + 1, seed=HELD_OUT_SEED))[index]


# ---- export ----------------------------------------------------------------------------------------------------------


def test_export_writes_a_qwen35moe_file_with_the_tokenizer_template_and_clovers_facts(exported):
    reader = gguf.GGUFReader(exported)
    fields = {key: reader.get_field(key).contents() for key in reader.fields if not key.startswith("GGUF.")}
    assert fields["general.architecture"] == "qwen35moe"
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen35"
    assert len(fields["tokenizer.ggml.tokens"]) == 2048 and fields["tokenizer.ggml.tokens"][2047] == "<|mask|>"
    assert fields["tokenizer.chat_template"] == (SHIPPED / "chat_template.jinja").read_text()
    assert fields["qwen35moe.attention.recurrent_layers"] == [True, False, True, False]
    assert read_clover_metadata(exported) == {
        "mask_token_id": 2047, "block_size": 32, "threshold": pytest.approx(0.95), "eos_token_ids": [2040, 2038],
    }  # fmt: skip
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.0.ssm_a", "blk.0.ffn_gate_exps.weight", "blk.1.attn_q.weight"} <= names  # fmt: skip
    assert len(names) == 73
    assert not [p for p in exported.parent.iterdir() if p != exported]  # no temporary left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert exported.stat().st_mode & 0o777 == 0o666 & ~umask  # as a file written normally, not mkstemp's 0600


def test_export_of_the_autoregressive_base_stacks_its_per_expert_tensors(tmp_path):
    # Qwen's released checkpoints store one tensor per expert; the AR base is saved that way.
    path = export_gguf(AR_BASE, tmp_path / "base.gguf", "f16")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [192, 160, 8]
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "F16"
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"  # routers stay f32
    assert read_clover_metadata(path) == {}


@pytest.mark.parametrize("gguf_type, file_type", [("q8_0", 7), ("q4_k_m", 15)])
def test_quantized_types_come_from_llama_cpps_quantizer_and_decode(tmp_path, tokenizer, gguf_type, file_type):
    path = export_gguf(SHIPPED, tmp_path / f"clover.{gguf_type}.gguf", gguf_type, threads=1)
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.file_type").contents() == file_type
    assert read_clover_metadata(path)["mask_token_id"] == 2047  # the quantizer keeps the extra keys
    model = LlamaCppClover(path, n_threads=1)
    try:
        out = model.generate(_prompt(tokenizer), max_new_tokens=64)
    finally:
        model.close()
    assert out.num_new_tokens > 0 and out.tokens_per_forward > 1


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"model_dir": "no-such-dir"}, r"--model no-such-dir: no such directory; pass a Clover or Qwen3\.5-MoE"),
        ({"type": "q3"}, r"--type 'q3' is not one of f32, f16, bf16, q8_0, q4_k_m"),
        ({"model_dir": "LLAMA"}, r"is a 'llama' checkpoint; this exporter writes the Qwen3\.5-MoE architecture"),
    ],
)
def test_export_refuses_bad_input_naming_the_value_and_the_fix(tmp_path, arguments, message):
    llama_dir = tmp_path / "llama"
    llama_dir.mkdir()
    (llama_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    arguments = {"model_dir": SHIPPED, "type": "f32"} | arguments
    if arguments["model_dir"] == "LLAMA":
        arguments["model_dir"] = llama_dir
    with pytest.raises(ValueError, match=message):
        export_gguf(arguments["model_dir"], tmp_path / "out.gguf", arguments["type"])
    assert not (tmp_path / "out.gguf").exists()


def test_a_failed_export_leaves_neither_output_nor_temporary(tmp_path, monkeypatch):
    def fail_halfway(model_dir, output, *args):
        Path(output).write_bytes(b"GGUF half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_clover, "_write_float_gguf", fail_halfway)
    (tmp_path / "old.gguf").write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="disk full"):
        export_gguf(SHIPPED, tmp_path / "old.gguf", "f16")
    assert [p.name for p in tmp_path.iterdir()] == ["old.gguf"]
    assert (tmp_path / "old.gguf").read_bytes() == b"previous"  # the previous file stays whole


def test_export_script_fails_like_a_command_line_tool(tmp_path):
    result = run_python("scripts/export_gguf.py", "--output", str(tmp_path / "x.gguf"), "--type", "int3", cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: --type 'int3' is not one of f32, f16, bf16, q8_0, q4_k_m; e.g. --type q8_0."]  # fmt: skip


# ---- forwards --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_causal_logits_match_transformers(llama, model, tokenizer):
    ids = _prompt(tokenizer)
    reference = model(torch.tensor([ids])).logits[0]
    logits = llama.causal_logits(ids)
    assert (logits - reference).abs().max() < 0.05
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@torch.no_grad()
def test_a_denoising_step_matches_transformers(llama, model, tokenizer):
    ids, mask = _prompt(tokenizer), model.config.mask_token_id
    canvas = [mask] * 32
    canvas[:5] = ids[-5:]  # some committed positions among the masks
    block_ids = torch.tensor([[-1] * len(ids) + [0] * 32])
    reference = model(torch.tensor([ids + canvas]), block_ids=block_ids).logits[0, len(ids) :]
    logits = llama.denoising_logits(ids, canvas)
    assert (logits - reference).abs().max() < 0.1
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_tokenizer_and_chat_template_in_the_file_match_the_checkpoints(llama, tokenizer):
    for example in generate_examples(8, seed=HELD_OUT_SEED):
        record = example.to_record()
        text = llama.apply_chat_template(
            record["messages"][:-1], tools=record.get("tools"), enable_thinking=record["enable_thinking"]
        )
        assert text == tokenizer.apply_chat_template(
            record["messages"][:-1], tools=record.get("tools"), enable_thinking=record["enable_thinking"],
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        assert llama.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- decoding --------------------------------------------------------------------------------------------------------


def _compare(llama, model, tokenizer, count: int, strategy: str) -> tuple[float, dict, dict]:
    examples = generate_examples(count, seed=HELD_OUT_SEED)
    prompts = prompt_ids(tokenizer, examples)
    reference = decode_transformers(model, prompts, strategy, max_new_tokens=192)
    decoded = decode_llama_cpp(llama, prompts, strategy, max_new_tokens=192)
    return agreement(reference, decoded), score(tokenizer, examples, decoded), score(tokenizer, examples, reference)


@pytest.mark.parametrize("strategy", ["low_confidence", "self_speculative"])
def test_decoding_gives_transformers_tokens_on_a_few_problems(llama, model, tokenizer, strategy):
    same, ours, theirs = _compare(llama, model, tokenizer, 8, strategy)
    assert same == 1.0
    assert ours["exact_match"] == theirs["exact_match"]
    assert ours["tokens_per_forward"] > (3 if strategy == "low_confidence" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["low_confidence", "self_speculative"])
def test_decoding_gives_transformers_tokens_on_100_held_out_problems(llama, model, tokenizer, strategy):
    # Measured: 100% of the tokens and the same exact match (90% at 0.95, 95% self-speculative).
    same, ours, theirs = _compare(llama, model, tokenizer, 100, strategy)
    assert same >= 0.95
    assert abs(ours["exact_match"] - theirs["exact_match"]) <= 0.01


@torch.no_grad()
def test_sampling_draws_generates_tokens_from_the_same_seed(llama, model, tokenizer):
    # One draw per undecided position, in generate's order, from nearly the same probabilities: the same samples.
    sampling = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    for seed, ids in enumerate(prompt_ids(tokenizer, generate_examples(6, seed=HELD_OUT_SEED))):
        ours = llama.generate(ids, max_new_tokens=192, seed=seed, **sampling)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=192, generator=torch.Generator().manual_seed(seed),
            return_dict_in_generate=True, **sampling,
        )  # fmt: skip
        assert ours.tokens == out.sequences[0, len(ids) : len(ids) + int(out.num_new_tokens[0])].tolist()


def test_self_speculative_output_is_llama_cpps_own_greedy_decoding(llama, tokenizer):
    ids = _prompt(tokenizer, 2)
    speculative = llama.generate(ids, max_new_tokens=96, strategy="self_speculative")
    autoregressive = llama.generate(ids, max_new_tokens=96, strategy="autoregressive")
    assert speculative.tokens == autoregressive.tokens
    assert speculative.num_forward_passes < autoregressive.num_forward_passes


def test_budget_and_eos_as_generate_handles_them(llama, tokenizer):
    ids = _prompt(tokenizer, 1)
    full = llama.generate(ids, max_new_tokens=192)
    assert full.tokens[-1] in llama.eos_token_ids and not set(full.tokens[:-1]) & set(llama.eos_token_ids)
    for budget in (1, 20, 33):  # a shorter budget yields a prefix of a longer one
        for strategy in ("low_confidence", "self_speculative"):
            short = llama.generate(ids, max_new_tokens=budget, strategy=strategy)
            assert short.tokens == full.tokens[:budget], (strategy, budget)


def test_sampling_reads_confidence_from_the_unwarped_distribution(llama, tokenizer):
    ids = _prompt(tokenizer, 3)
    greedy = llama.generate(ids, max_new_tokens=96)
    # top_k=1 leaves one candidate, the argmax: the same tokens and, confidence being read before the warpers,
    # the same commits per forward.
    top1 = llama.generate(ids, max_new_tokens=96, do_sample=True, top_k=1, temperature=0.5, seed=1)
    assert (top1.tokens, top1.num_forward_passes) == (greedy.tokens, greedy.num_forward_passes)
    first = llama.generate(ids, max_new_tokens=96, do_sample=True, temperature=1.5, seed=7)
    again = llama.generate(ids, max_new_tokens=96, do_sample=True, temperature=1.5, seed=7)
    assert first.tokens == again.tokens  # seeded


def test_generate_refuses_bad_arguments(llama, tokenizer):
    ids = _prompt(tokenizer)
    with pytest.raises(ValueError, match=r"threshold \(1\.5\) must be in \(0, 1\]"):
        llama.generate(ids, threshold=1.5)
    with pytest.raises(ValueError, match="contains the mask token"):
        llama.generate([*ids, llama.mask_token_id])
    with pytest.raises(ValueError, match="is greedy: it takes do_sample=False"):
        llama.generate(ids, strategy="self_speculative", do_sample=True)
    with pytest.raises(ValueError, match="drop repetition_penalty"):
        llama.generate(ids, strategy="self_speculative", repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"need a context of \d+; this one holds 2048"):
        llama.generate(ids, max_new_tokens=4000)


def test_a_plain_qwen_gguf_or_another_file_is_refused_with_the_fix(tmp_path):
    path = export_gguf(AR_BASE, tmp_path / "base.gguf", "f16")
    with pytest.raises(ValueError, match="not a Clover GGUF"):
        LlamaCppClover(path)
    with pytest.raises(ValueError, match=r"README.md is not a GGUF file .*scripts/export_gguf.py"):
        LlamaCppClover(REPO / "README.md")


def test_experts_on_cpu_places_the_experts_in_system_memory(exported):
    # On a CPU build everything is in system memory anyway: llama.cpp's log shows the override applied.
    code = (
        "from clover.llama_cpp_clover import LlamaCppClover\n"
        f"LlamaCppClover({str(exported)!r}, n_threads=1, experts_on_cpu=True, verbose=True)"
    )
    result = run_python("-c", code, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "blk.0.ffn_down_exps.weight" in result.stderr and "buffer type overridden to CPU" in result.stderr


def test_generate_script_decodes_a_gguf(exported):
    result = run_python(
        "scripts/generate.py", "--gguf", str(exported), "--no-thinking", "Reverse: apple river stone",
        "--max-new-tokens", "32", cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"-- \d+ new tokens, \d+ forwards, [\d.]+ tokens/forward, [\d.]+ tok/s", result.stdout)


# ---- llama.cpp's server ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_llama_cpp_server_streams_a_chat_completion_of_an_exported_clover(exported, llama):
    pytest.importorskip("uvicorn", reason="llama-cpp-python's server extra is not installed")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(exported), "--host", "127.0.0.1", "--port", str(port),
         "--n_threads", "1", "--n_ctx", "1024", "--verbose", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready once it lists the model
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=2) as response:
                    assert json.load(response)["data"]
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the server did not start: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
        messages = [{"role": "user", "content": "Sort these numbers: 5, 3, 9, 1"}]
        body = {"messages": messages, "stream": True, "max_tokens": 96, "temperature": 0, "repeat_penalty": 1.0}
        request = urllib.request.Request(
            f"{base}/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        chunks = []
        with urllib.request.urlopen(request, timeout=60) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: ") :]))
                elif line == "data: [DONE]":
                    break
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(chunks) > 3 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # The server runs Clover's causal path: llama.cpp's greedy decoding of the same chat prompt.
    expected = llama.generate(llama.tokenize(llama.apply_chat_template(messages)), max_new_tokens=96, strategy="autoregressive")  # fmt: skip
    assert text == llama.detokenize(expected.tokens)
