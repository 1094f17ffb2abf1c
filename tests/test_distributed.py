"""scripts/train.py on several processes: `accelerate launch` with the configs in configs/, two CPU processes over
gloo on the shipped demo checkpoint. Two processes train like one with the same global batch (same loss curve, same
weights), a killed run resumes to the weights of an uninterrupted one, LoRA merges under data parallelism, and the
FSDP config shards at Clover's decoder layers. Also the per-example noise and the step-wide loss normalisation these
rest on."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from clover.training_clover import CloverDataCollator, number_examples

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "clover-tiny-demo"
CONFIGS = REPO / "configs"
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "forest", "candle", "rocket", "silver"]
PAD = 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _command(argv: list[str], processes: int, config: str = "ddp.yaml") -> list[str]:
    script = [str(REPO / "scripts" / "train.py"), "--model", str(DEMO), *argv]
    if processes == 1:
        return [sys.executable, *script]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
    return [*launch, "--num_processes", str(processes), "--main_process_port", str(_free_port()), *script]


def _train(argv: list[str], processes: int = 1, config: str = "ddp.yaml") -> str:
    result = subprocess.run(
        _command(argv, processes, config), env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


def _losses(output: Path) -> list[float]:
    return [entry["loss"] for entry in json.loads((output / "learning_curve.json").read_text()) if "loss" in entry]


def _assert_same_weights(a: Path, b: Path, atol: float) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(
            second[name], first[name], rtol=0, atol=atol, msg=lambda text, name=name: f"{name}: {text}"
        )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """16 chats whose answers run 1 to 4 words: batches hold different numbers of supervised tokens."""
    path = tmp_path_factory.mktemp("data") / "repeat.jsonl"
    lines = []
    for i in range(16):
        word, times = WORDS[i % len(WORDS)], 1 + i % 4
        messages = [
            {"role": "user", "content": f"Repeat the word {times} times: {word}"},
            {"role": "assistant", "content": " ".join([word] * times)},
        ]
        lines.append(json.dumps({"messages": messages, "enable_thinking": False}))
    path.write_text("\n".join(lines) + "\n")
    return path


RUN = ["--max-steps", "3", "--logging-steps", "1", "--lr", "1e-3", "--seed", "0"]
# Adam turns float noise in a near-zero gradient into a step of up to lr, so equal runs whose sums are merely ordered
# differently end up to ~1e-5 apart; averaging per-batch means instead of the step's token mean: ~4e-3.
WEIGHTS_ATOL = 1e-4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data) -> Path:
    """The reference: one process, batch 4."""
    output = tmp_path_factory.mktemp("one") / "out"
    _train(["--data", str(data), "--output", str(output), "--batch-size", "4", *RUN])
    return output


# --------------------------------------------------------------------------------------------------------------------
# Data parallel (DDP) over two processes
# --------------------------------------------------------------------------------------------------------------------


def test_two_processes_train_like_one_with_the_same_global_batch(one_process, data, tmp_path):
    output = tmp_path / "two"
    log = _train(["--data", str(data), "--output", str(output), "--batch-size", "2", *RUN], processes=2)
    assert "trained on 2 processes" in log
    reference, losses = _losses(one_process), _losses(output)
    assert len(reference) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0)
    _assert_same_weights(one_process, output, atol=WEIGHTS_ATOL)
    # One consolidated checkpoint, written once, loading with its own code; and training moved it.
    model = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)
    assert type(model).__name__ == "CloverForBlockDiffusion"
    assert sorted(p.name for p in output.parent.iterdir()) == ["two"]  # no work dir left by either process
    shipped = load_file(DEMO / "model.safetensors")
    moved = max((tensor - shipped[name]).abs().max().item() for name, tensor in model.state_dict().items())
    assert moved > 1e-4


def test_gradient_accumulation_trains_like_the_bigger_batch(one_process, data, tmp_path):
    output = tmp_path / "accumulated"
    _train(["--data", str(data), "--output", str(output), "--batch-size", "2", "--grad-accum", "2", *RUN])
    torch.testing.assert_close(torch.tensor(_losses(output)), torch.tensor(_losses(one_process)), rtol=1e-5, atol=0)
    _assert_same_weights(one_process, output, atol=WEIGHTS_ATOL)


@pytest.mark.slow
def test_lora_under_data_parallelism_is_merged_like_one_process(data, tmp_path):
    lora = ["--lora", "4", "--lr", "1e-2", "--max-steps", "3", "--logging-steps", "1", "--seed", "0"]
    one, two = tmp_path / "one", tmp_path / "two"
    _train(["--data", str(data), "--output", str(one), "--batch-size", "4", *lora])
    _train(["--data", str(data), "--output", str(two), "--batch-size", "2", *lora], processes=2)
    assert not (two / "adapter_config.json").exists()  # merged: a plain checkpoint
    _assert_same_weights(one, two, atol=1e-4)  # lr 1e-2 under Adam: 1% of how far the weights move
    torch.testing.assert_close(torch.tensor(_losses(two)), torch.tensor(_losses(one)), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------------------------------
# Kill, resume, finish
# --------------------------------------------------------------------------------------------------------------------


def _kill_after_first_checkpoint(argv: list[str], processes: int, checkpoints: Path) -> None:
    """Starts a run and kills it (SIGKILL, every process) once its first checkpoint is complete."""
    process = subprocess.Popen(
        _command(argv, processes),
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    try:
        while not (checkpoints / "checkpoint-2" / "trainer_state.json").is_file():
            assert process.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
    finally:  # the launcher and every process under it (torch's launcher starts its workers in sessions of their own)
        victims = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for victim in victims:
            victim.kill()
        psutil.wait_procs(victims, timeout=60)
        process.wait()


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(processes, data, tmp_path):
    batch = str(4 // processes)
    run = ["--data", str(data), "--batch-size", batch, "--max-steps", "16", "--save-steps", "2", "--seed", "0"]
    run += ["--lr", "1e-3", "--logging-steps", "1"]  # 16 steps: four epochs of 4 steps, resumed mid-epoch
    whole = tmp_path / "whole"
    _train([*run, "--output", str(whole), "--checkpoint-dir", str(tmp_path / "whole-checkpoints")], processes)

    checkpoints, resumed = tmp_path / "checkpoints", tmp_path / "resumed"
    argv = [*run, "--output", str(resumed), "--checkpoint-dir", str(checkpoints)]
    _kill_after_first_checkpoint(argv, processes, checkpoints)
    assert not resumed.exists()
    done = [int(p.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    assert done and max(done) < 16, done  # killed part-way
    _train([*argv, "--resume-from-checkpoint"], processes)
    _assert_same_weights(whole, resumed, atol=1e-6)
    torch.testing.assert_close(torch.tensor(_losses(resumed)), torch.tensor(_losses(whole)), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------------------------------
# FSDP: the config's wrap units; on CPU accelerate trains data parallel instead, and says so
# --------------------------------------------------------------------------------------------------------------------

_WRAP_CHECK = """
import os, sys, torch, torch.distributed as dist, yaml
from accelerate import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import AutoModelForCausalLM

config_file, model_dir, port = sys.argv[1:]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=0, world_size=1)
fsdp = yaml.safe_load(open(config_file))["fsdp_config"]
model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=fsdp["fsdp_version"],
    auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
    transformer_cls_names_to_wrap=fsdp["fsdp_transformer_layer_cls_to_wrap"],
    state_dict_type=fsdp["fsdp_state_dict_type"],
)
plugin.set_auto_wrap_policy(model)
policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
units = [name for name, module in model.named_modules() if policy(module)]
for name in units:
    fully_shard(model.get_submodule(name))
fully_shard(model)
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
print("units", ",".join(units))
print("sharded", sum(isinstance(m, FSDPModule) for m in model.modules()))
print("full", sorted(full) == sorted(before) and all(torch.equal(full[k], before[k]) for k in before))
"""


def test_fsdp_config_shards_at_the_decoder_layers_and_saves_a_full_state_dict():
    config = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    model = AutoModelForCausalLM.from_pretrained(DEMO, trust_remote_code=True)
    fsdp = config["fsdp_config"]
    assert config["distributed_type"] == "FSDP"
    assert {fsdp["fsdp_transformer_layer_cls_to_wrap"]} == set(model._no_split_modules)
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # the final save is one whole checkpoint
    # accelerate's own policy from the config, applied by torch's FSDP2 on a one-process gloo group.
    check = [sys.executable, "-c", _WRAP_CHECK, str(CONFIGS / "fsdp.yaml"), str(DEMO), str(_free_port())]
    result = subprocess.run(check, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    layers = model.config.num_hidden_layers
    assert lines["units"].split(",") == [f"model.layers.{i}" for i in range(layers)]
    assert lines["sharded"] == str(layers + 1)  # every decoder layer, and the root for the rest
    assert lines["full"] == "True"


@pytest.mark.slow
def test_fsdp_config_on_cpu_trains_data_parallel_and_warns(one_process, data, tmp_path):
    output = tmp_path / "fsdp"
    argv = ["--data", str(data), "--output", str(output), "--batch-size", "2", *RUN]
    log = _train(argv, processes=2, config="fsdp.yaml")
    assert "accelerate runs FSDP on GPUs" in log and "trained on 2 processes (MULTI_CPU)" in log
    _assert_same_weights(one_process, output, atol=WEIGHTS_ATOL)


# --------------------------------------------------------------------------------------------------------------------
# What the equalities rest on: per-example noise, and errors of the resume flag
# --------------------------------------------------------------------------------------------------------------------


def _examples(lengths) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {"prompt_ids": torch.randint(1, 100, (3 + i,), generator=gen).tolist(), "answer_ids": [5] * n}
        for i, n in enumerate(lengths)
    ]


def test_per_example_noise_does_not_depend_on_the_batch_around_it():
    features = number_examples(_examples([3, 13, 7, 21]), start=10)
    collator = CloverDataCollator(PAD, 8, seed=4, per_example_noise=True)
    together = collator(features)
    answers_at = max(len(f["prompt_ids"]) for f in features)  # every row's answer starts at this column
    for row, feature in enumerate(features):
        alone = collator([feature])
        span = -(-len(feature["answer_ids"]) // 8) * 8  # the row's own answer blocks
        own = len(feature["prompt_ids"])
        for key in ("noise_mask", "noise_level"):
            torch.testing.assert_close(
                together[key][row, answers_at : answers_at + span], alone[key][0, own : own + span]
            )
    assert together["noise_mask"].any()
    collator.epoch = 1  # another epoch, other masks
    assert not torch.equal(collator(features)["noise_mask"], together["noise_mask"])
    other_seed = CloverDataCollator(PAD, 8, seed=5, per_example_noise=True)(features)
    assert not torch.equal(other_seed["noise_mask"], together["noise_mask"])


def test_per_example_noise_needs_an_example_index():
    with pytest.raises(ValueError, match=r"Example 0 has no integer 'example_index' \(got None\).*number_examples"):
        CloverDataCollator(PAD, 8, per_example_noise=True)(_examples([3]))


def test_resume_without_a_path_needs_a_checkpoint_dir(data, tmp_path):
    result = subprocess.run(
        _command(["--data", str(data), "--output", str(tmp_path / "o"), "--resume-from-checkpoint"], 1),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--resume-from-checkpoint without a path resumes from --checkpoint-dir: pass that too" in result.stderr


def test_deepspeed_config_is_zero3_and_saves_one_checkpoint():
    launch = yaml.safe_load((CONFIGS / "deepspeed_zero3.yaml").read_text())
    assert launch["distributed_type"] == "DEEPSPEED"
    ds = json.loads((REPO / launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
