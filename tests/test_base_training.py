"""scripts/train_base.py: the demo's autoregressive base fine-tuned on a chat JSONL by transformers.Trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from clover.demo.tasks import generate_examples, write_chat_jsonl

REPO = Path(__file__).resolve().parents[1]
BASE = Path(os.environ.get("CLOVER_DEMO_BASE", REPO / "models" / "qwen3_5_moe-tiny-demo"))


def test_train_base_fine_tunes_and_resumes_and_the_output_loads(tmp_path):
    data = tmp_path / "train.jsonl"
    write_chat_jsonl(generate_examples(24, seed=3, wording="train"), data)
    command = [sys.executable, str(REPO / "scripts" / "train_base.py"), "--model", str(BASE), "--data", str(data),
               "--output", str(tmp_path / "out"), "--max-steps", "2", "--batch-tokens", "1024", "--lr", "1e-3",
               "--checkpoint-dir", str(tmp_path / "checkpoints"), "--save-steps", "1", "--logging-steps", "1",
               "--threads", "1"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Compared as loaded models: how the file names the weights depends on the transformers release.
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    before = AutoModelForCausalLM.from_pretrained(BASE).state_dict()
    assert tuned.keys() == before.keys()
    assert any(not torch.equal(tuned[name], before[name]) for name in tuned)
    # A rerun with more steps goes on from the newest checkpoint rather than starting over.
    command[command.index("--max-steps") + 1] = "3"
    command.append("--force")  # the finished output of the first run is replaced
    again = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints' / 'checkpoint-2'}" in again.stdout
    history = json.loads((tmp_path / "out" / "learning_curve.json").read_text())
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2, 3]  # step 3 logged once: resumed
