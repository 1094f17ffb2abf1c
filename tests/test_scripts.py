"""Every command-line script fails like a command-line tool: one bad input gives exit status 2 and one line on
stderr naming the value and the fix, never a traceback. Each case runs the script in a fresh process, stdin closed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_python

from clover.cli_clover import replace_directory
from clover.demo.tasks import DATA_POSITIONS, FAMILIES, OUT_OF_SCOPE, generate_examples

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "clover-tiny-demo"
MISSING = "no-such-checkpoint"


# script (and what is wrong) -> (its arguments, given a scratch directory; what the error line must say)
CASES = {
    "generate.py: threshold": (lambda tmp: ["hi", "--threshold", "1.5"], r"threshold \(1\.5\) must be in \(0, 1\]"),
    "generate.py: empty prompt": (lambda tmp: ["  "], r"The prompt is empty: pass the text to answer"),
    "generate.py: long prompt": (
        lambda tmp: ["apple " * 1100, "--raw", "--max-new-tokens", "16"],
        r"The prompt \(\d+ tokens\) and max_new_tokens \(16\) need \d+ tokens, \d+ over the context of 1024: "
        r"shorten the prompt by \d+ tokens\.$",
    ),
    "generate.py: tools file": (
        lambda tmp: ["hi", "--tools", str(a_file(tmp))],
        r"--tools .*a-file: not a readable JSON file",
    ),
    "generate.py: AR base": (
        lambda tmp: ["hi", "--model", str(REPO / "models" / "qwen3_5_moe-tiny-demo")],
        r"qwen3_5_moe-tiny-demo is a qwen3_5_moe_text checkpoint, not a Clover one: .* scripts/convert_qwen3_5_moe\.py",
    ),
    "train.py": (
        lambda tmp: ["--model", MISSING, "--data", "x.jsonl", "--output", str(tmp / "out")],
        r"No checkpoint at no-such-checkpoint \(no config.json there\): pass --model DIR",
    ),
    "train.py: keep-wrong without decoding states": (
        lambda tmp: ["--model", MISSING, "--data", "x.jsonl", "--output", str(tmp / "out"), "--keep-wrong-masked"],
        r"--keep-wrong-masked changes the decoding states of --decoding-state-noise P: pass P > 0 too",
    ),
    "train_base.py": (
        lambda tmp: ["--model", MISSING, "--data", "x.jsonl", "--output", str(tmp / "out"), "--max-steps", "1"],
        r"No checkpoint at no-such-checkpoint \(no config.json there\): pass --model DIR",
    ),
    "train_base.py: existing output": (
        lambda tmp: [
            "--model",
            str(REPO / "models" / "qwen3_5_moe-tiny-demo"),
            "--data",
            str(a_file(tmp)),
            "--output",
            str(trained_model(tmp)),
            "--max-steps",
            "1",
        ],  # fmt: skip
        r"trained exists; pass --force to replace it",
    ),
    "train_demo.py": (lambda tmp: ["--layers", "lxf", "--work", str(tmp / "work")], r"--layers \('lxf'\) must be"),
    "train_demo.py: existing output": (
        lambda tmp: [*demo_dirs(tmp), "--output", str(trained_model(tmp)), "--stages", "data"],
        r"trained exists and this run did not write it; pass --force to replace it",
    ),
    "train_demo.py: missing checkpoint": (
        lambda tmp: [*demo_dirs(tmp), "--resume-from", MISSING],
        r"--resume-from no-such-checkpoint: no Trainer checkpoint there",
    ),
    "eval_demo.py": (lambda tmp: ["--model", MISSING], r"No checkpoint at no-such-checkpoint"),
    "eval_demo.py: self-speculative AR base": (
        lambda tmp: ["--model", str(REPO / "models" / "qwen3_5_moe-tiny-demo"), "--self-speculative"],
        r"--self-speculative needs a Clover checkpoint; .*qwen3_5_moe-tiny-demo is a qwen3_5_moe_text",
    ),
    "bench.py": (lambda tmp: ["--model", MISSING], r"No checkpoint at no-such-checkpoint"),
    "export_gguf.py": (
        lambda tmp: ["--model", MISSING, "--output", str(tmp / "x.gguf")],
        r"--model no-such-checkpoint: no such directory; pass a Clover or Qwen3\.5-MoE checkpoint directory",
    ),
    "eval_llama_cpp.py": (lambda tmp: ["--types", "q3"], r"--types: 'q3' is not one of f32, f16, bf16, q8_0, q4_k_m"),
    "average_weights.py": (
        lambda tmp: [str(SHIPPED), "--output", str(tmp / "soup")],
        r"Got 1 checkpoint; pass two or more checkpoint directories",
    ),
    "average_weights.py: another model": (
        lambda tmp: [str(SHIPPED), str(REPO / "models" / "qwen3_5_moe-tiny-demo"), "--output", str(tmp / "soup")],
        r"qwen3_5_moe-tiny-demo has another configuration than .*clover-tiny-demo \(differs in .*model_type",
    ),
    "add_layers.py": (
        lambda tmp: ["--model", str(SHIPPED), "--copy", "1", "4", "--output", str(tmp / "deeper")],
        r"--copy \[4\]: the model has layers 0-3; name layers in that range",
    ),
    "build_tokenizer.py": (lambda tmp: ["--output", str(a_file(tmp))], r"a-file is a file: pass a directory"),
    "convert_qwen3_5_moe.py": (lambda tmp: ["--input", MISSING, "--output", str(tmp / "c")], r"has no config.json"),
    "memory.py": (lambda tmp: ["--config", "nope.json"], r"--config 'nope.json' is neither '35B' nor a config.json"),
    "sync_model_code.py": (lambda tmp: [MISSING], r"No checkpoint at no-such-checkpoint"),
}


def trained_model(tmp: Path) -> Path:
    path = tmp / "trained"
    path.mkdir()
    (path / "model.safetensors").write_text("weights someone trained")
    return path


# A demo run small enough to train every stage in seconds.
SMALL_DEMO = ["--num-examples", "40", "--copy-warmup-examples", "8", "--warmup-examples", "8", "--vocab-size", "1200",
              "--hidden-size", "32", "--moe-intermediate-size", "16", "--shared-expert-intermediate-size", "16",
              "--batch-tokens", "1024", "--save-steps", "2", "--threads", "1"]  # fmt: skip


def demo_dirs(tmp: Path) -> list[str]:
    return ["--output", str(tmp / "clover"), "--base-output", str(tmp / "base"), "--work", str(tmp / "work")]


def run_script(name: str, *arguments: str, cwd: Path):
    return run_python(str(REPO / "scripts" / name), *arguments, cwd=cwd, timeout=600)


def a_file(tmp: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_script_reports_a_bad_input_in_one_line_with_status_2(case, tmp_path):
    arguments, message = CASES[case]
    result = run_script(case.split(":")[0], *arguments(tmp_path), cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.search(message, errors[0]), errors[0]


def test_every_script_has_a_case():
    scripts = {path.name for path in (REPO / "scripts").glob("*.py")}
    assert scripts == {case.split(":")[0] for case in CASES}


def test_average_weights_writes_the_mean_and_it_loads(tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shifted = tmp_path / "shifted"
    shutil.copytree(SHIPPED, shifted)
    original = load_file(SHIPPED / "model.safetensors")
    save_file({name: tensor + 1.0 for name, tensor in original.items()}, shifted / "model.safetensors")
    result = run_script("average_weights.py", str(SHIPPED), str(shifted), "--output", "soup", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    averaged = load_file(tmp_path / "soup" / "model.safetensors")
    assert averaged.keys() == original.keys()
    for name, tensor in original.items():
        torch.testing.assert_close(averaged[name], tensor + 0.5, rtol=0, atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "soup", trust_remote_code=True)
    torch.testing.assert_close(model.lm_head.weight, original["lm_head.weight"] + 0.5, rtol=0, atol=1e-6)
    again = run_script("average_weights.py", str(SHIPPED), str(shifted), "--output", "soup", cwd=tmp_path)
    assert again.returncode == 2 and "pass --force" in again.stderr  # an existing output is kept


@pytest.mark.parametrize("model", ["clover-tiny-demo", "qwen3_5_moe-tiny-demo"])
def test_add_layers_appends_copies_that_leave_the_function_unchanged(model, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = REPO / "models" / model
    result = run_script(
        "add_layers.py", "--model", str(source), "--copy", "1", "2", "--output", "deeper", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    original, deeper = load_file(source / "model.safetensors"), load_file(tmp_path / "deeper" / "model.safetensors")
    for new, copied in ((4, 1), (5, 2)):
        names = [name for name in original if name.startswith(f"model.layers.{copied}.")]
        for name in names:
            tensor = deeper[name.replace(f".layers.{copied}.", f".layers.{new}.")]
            if name.endswith(("o_proj.weight", "out_proj.weight")) or ".mlp." in name and "down_proj" in name:
                assert not tensor.any(), name
            else:
                assert torch.equal(tensor, original[name]), name
    assert len(deeper) == len(original) + sum(name.startswith(("model.layers.1.", "model.layers.2.")) for name in original)  # fmt: skip
    models = [AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True) for path in (source, tmp_path / "deeper")]  # fmt: skip
    assert models[1].config.num_hidden_layers == 6
    assert models[1].config.layer_types[4:] == models[0].config.layer_types[1:3]
    input_ids = torch.randint(0, 2000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models[1](input_ids).logits, models[0](input_ids).logits, atol=1e-4, rtol=1e-4)
    again = run_script("add_layers.py", "--model", str(source), "--copy", "1", "--output", "deeper", cwd=tmp_path)
    assert again.returncode == 2 and "pass --force" in again.stderr  # an existing output is kept
    assert len(load_file(tmp_path / "deeper" / "model.safetensors")) == len(deeper)


def test_eval_demo_decodes_self_speculatively_too(tmp_path):
    """--self-speculative adds a row to each set's table and to the JSON; the plot keeps the thresholds only. The
    additions are also counted by kind (direct or worked), apart from the families; the held-out wordings add the
    requests outside the families."""
    result = run_script("eval_demo.py", "--per-family", "1", "--thresholds", "0.95", "--self-speculative",
                        "--output", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^\s*self_speculative \|", result.stdout, re.MULTILINE), result.stdout
    by_set = json.loads((tmp_path / "eval_demo.json").read_text())["results"]
    assert set(by_set) == {"templates", "held_out"}
    assert by_set["held_out"]["0.95"]["counts"]["out_of_scope"]["total"] == 1
    results = by_set["templates"]
    assert set(results) == {"0.95", "self_speculative"}
    counts = results["self_speculative"]["counts"]
    assert sum(counts[family]["total"] for family in FAMILIES) == 4
    kinds = [counts[kind] for kind in ("addition_direct", "addition_worked") if kind in counts]
    assert (
        sum(kind["total"] for kind in kinds) == 1
        and sum(kind["correct"] for kind in kinds) == counts["addition"]["correct"]
    )
    assert re.search(r"^additions by kind", result.stdout, re.MULTILINE), result.stdout
    assert (tmp_path / "eval_demo.png").is_file()


def test_eval_demo_scores_the_bank_training_wordings_on_request(tmp_path):
    """--wordings train: fresh problems worded by the bank's training part, requests outside the families included."""
    result = run_script("eval_demo.py", "--per-family", "1", "--thresholds", "0.95", "--wordings", "train",
                        "--output", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    by_set = json.loads((tmp_path / "eval_demo.json").read_text())["results"]
    assert set(by_set) == {"train"}
    counts = by_set["train"]["0.95"]["counts"]
    assert sum(counts[family]["total"] for family in FAMILIES) == 4 and counts["out_of_scope"]["total"] == 1
    # the additions, sorts and reversals counted again by where their data stand in the request
    positions = [counts.get(position, {"total": 0})["total"] for position in DATA_POSITIONS]
    assert sum(positions) == 3
    by_family = [counts.get(f"{f}/{p}", {"total": 0})["total"] for f in FAMILIES[:3] for p in DATA_POSITIONS]
    assert sum(by_family) == 3
    assert ("by where the data stand" in result.stdout) == (positions[1] > 0)


def test_train_demo_keeps_an_output_it_did_not_write(tmp_path):
    existing = trained_model(tmp_path)
    result = run_script("train_demo.py", *demo_dirs(tmp_path), "--output", str(existing), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert (existing / "model.safetensors").read_text() == "weights someone trained"
    assert not (tmp_path / "work" / "train.jsonl").exists()  # refused before any stage ran


def test_train_demo_refuses_a_checkpoint_of_another_model(tmp_path):
    small = ["--num-examples", "60", "--copy-warmup-examples", "8", "--warmup-examples", "8", "--vocab-size", "1200"]
    data = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "data", *small, cwd=tmp_path)
    assert data.returncode == 0, data.stderr[-2000:]
    foreign = tmp_path / "checkpoint-7"
    foreign.mkdir()
    (foreign / "trainer_state.json").write_text("{}")
    (foreign / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    result = run_script(
        "train_demo.py", *demo_dirs(tmp_path), "--stages", "base", *small, "--resume-from", str(foreign), cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is a checkpoint of another model (model_type='llama'" in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "work" / "base").exists() or not any((tmp_path / "work" / "base").iterdir())


def test_train_demo_adds_extra_additions_to_the_corpus(tmp_path):
    """--easy-direct-sums N adds N 2-digit sums answered directly to train.jsonl, --direct-sums N adds N 2-3 digit
    ones, --worked-additions N adds N additions worked out with thinking on, --hard-examples N adds N problems from
    the top of each family's size range; without them the corpus is the one the shipped models were made from, and a
    run recorded before the options existed goes on under them."""
    small = ["--num-examples", "60", "--copy-warmup-examples", "8", "--warmup-examples", "8", "--vocab-size", "1200",
             "--mix", "0.3", "0.26", "0.24", "0.2"]  # fmt: skip
    plain = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "data", *small, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    records = read_jsonl(tmp_path / "work" / "train.jsonl")
    expected = generate_examples(60, seed=1, weights=[0.3, 0.26, 0.24, 0.2])
    plain_records = [example.to_record() for example in expected]
    assert records == plain_records
    run_file = tmp_path / "work" / "run.json"
    run = json.loads(run_file.read_text())
    del run["settings"]["data"]["easy_direct_sums"]  # as recorded before the options existed
    del run["settings"]["data"]["worked_additions"]
    del run["settings"]["data"]["direct_sums"]
    del run["settings"]["data"]["hard_examples"]
    run_file.write_text(json.dumps(run))
    again = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "data", *small, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]

    def corpus_with(option: str, count: int) -> list[dict]:
        work = tmp_path / option.strip("-")
        work.mkdir()
        done = run_script("train_demo.py", *demo_dirs(work), "--stages", "data", *small, option, str(count),
                          cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        records = read_jsonl(work / "work" / "train.jsonl")
        assert len(records) == 60 + count
        return records

    records = corpus_with("--easy-direct-sums", 30)
    direct = [r for r in records if r["family"] == "addition" and not r["enable_thinking"]]
    two_digit = [r for r in direct if re.fullmatch(r"\d\d \+ \d\d = \d+", r["expected"])]
    assert len(two_digit) >= 30
    assert records[:30] != [r for r in records if r not in two_digit][:30]  # mixed in, not appended

    records = corpus_with("--worked-additions", 40)
    with_working = [r for r in records if r["family"] == "addition" and r["enable_thinking"]]
    assert len(with_working) >= 40
    assert all("answer " in r["messages"][-1]["reasoning_content"] for r in with_working)
    assert records[:40] != with_working[:40]  # mixed in, not appended

    records = corpus_with("--direct-sums", 40)
    direct = [r for r in records if r["family"] == "addition" and not r["enable_thinking"]]
    assert len(direct) >= 40
    assert all(re.fullmatch(r"\d{2,3} \+ \d{2,3} = \d+", r["expected"]) for r in direct)
    assert any(re.fullmatch(r"\d{3} \+ \d{3} = \d+", r["expected"]) for r in direct)
    assert records[:40] != direct[:40]  # mixed in, not appended

    records = corpus_with("--hard-examples", 40)
    long_reversals = [r for r in records if r["family"] == "reversal" and len(r["expected"].split()) >= 8]
    plain_reversals = [e for e in expected if e.family == "reversal" and len(e.expected.split()) >= 8]
    assert len(long_reversals) > len(plain_reversals) + 5  # about 40 x 0.24 more, all of 8-10 words
    added = [i for i, r in enumerate(records) if r not in plain_records]
    assert len(added) == 40 and min(added) < 60  # mixed in, not appended


def test_train_demo_words_the_corpus_by_the_bank(tmp_path):
    """--wording train: the tokenizer and every part of the corpus are worded by the bank's training part, at every
    size a user asks about, with a tenth of the conversations outside the families."""
    small = ["--num-examples", "60", "--copy-warmup-examples", "8", "--warmup-examples", "8", "--vocab-size", "1200",
             "--mix", "0.3", "0.26", "0.24", "0.2", "--wording", "train"]  # fmt: skip
    done = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "data", *small, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    work = tmp_path / "work"
    expected = generate_examples(
        60, 1, (*FAMILIES, OUT_OF_SCOPE), [0.3, 0.26, 0.24, 0.2, 1 / 9], "wide", wording="train"
    )
    assert read_jsonl(work / "train.jsonl") == [example.to_record() for example in expected]
    copy_warmup = generate_examples(8, 4, ("reversal",), level="warmup", wording="train")
    assert read_jsonl(work / "warmup-copy.jsonl") == [example.to_record() for example in copy_warmup]
    assert json.loads((work / "run.json").read_text())["settings"]["data"]["wording"] == "train"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_demo_extends_a_finished_base(tmp_path):
    """A finished base rerun with a larger --base-steps resumes from its last checkpoint; convert and adapt are then
    redone, the run's record keeps what it replaced, and a smaller --base-steps is refused."""
    first = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "data", "base", "--base-steps", "2", *SMALL_DEMO,
                       cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    more = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "base", "--base-steps", "4", *SMALL_DEMO,
                      cwd=tmp_path)  # fmt: skip
    assert more.returncode == 0, more.stderr[-2000:]
    assert "extending 2 steps to 4" in more.stdout
    run = json.loads((tmp_path / "work" / "run.json").read_text())
    assert run["stages"]["base"]["steps"] == 4 and run["stages"]["superseded"]["base"]["steps"] == 2
    curve = json.loads((tmp_path / "base" / "learning_curve.json").read_text())
    assert max(entry["step"] for entry in curve) == 4
    fewer = run_script("train_demo.py", *demo_dirs(tmp_path), "--stages", "base", "--base-steps", "3", *SMALL_DEMO,
                       cwd=tmp_path)  # fmt: skip
    assert fewer.returncode == 2 and "base_steps: 4 -> 3" in fewer.stderr, fewer.stderr[-2000:]


def test_train_demo_extends_a_finished_adaptation(tmp_path):
    """A finished adaptation rerun with a larger --adapt-steps resumes from its last checkpoint (the base and the
    conversion untouched) and keeps the record of the shorter run; the published Clover is the longer one."""
    small = [*SMALL_DEMO, "--base-steps", "2"]
    first = run_script("train_demo.py", *demo_dirs(tmp_path), *small, "--adapt-steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    more = run_script("train_demo.py", *demo_dirs(tmp_path), *small, "--adapt-steps", "4", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "adapt: extending 2 steps to 4 from its last checkpoint" in more.stdout
    assert "base: done" in more.stdout and "convert: done" in more.stdout
    assert sorted(path.name for path in (tmp_path / "work" / "adapt").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    run = json.loads((tmp_path / "work" / "run.json").read_text())
    assert run["stages"]["adapt"]["steps"] == 4 and run["stages"]["superseded"]["adapt"]["steps"] == 2
    curve = json.loads((tmp_path / "clover" / "learning_curve.json").read_text())
    assert {entry["step"] for entry in curve if "eval_loss" in entry} == {2, 4}  # the first run's history kept


def test_train_demo_redoes_an_adaptation_with_other_settings(tmp_path):
    """An adaptation rerun with other settings starts again from the converted base: the base is not retrained, the
    previous adaptation's checkpoints and record are kept, and the output it wrote is replaced without --force."""
    small = [*SMALL_DEMO, "--base-steps", "2", "--adapt-steps", "2"]
    first = run_script("train_demo.py", *demo_dirs(tmp_path), *small, "--adapt-lr", "1e-3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    base_weights = (tmp_path / "base" / "model.safetensors").read_bytes()
    again = run_script("train_demo.py", *demo_dirs(tmp_path), *small, "--adapt-lr", "2e-3", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "adapt: other settings (adapt_lr: 0.001 -> 0.002)" in again.stdout
    assert "base: done" in again.stdout and "convert: done" in again.stdout
    assert (tmp_path / "base" / "model.safetensors").read_bytes() == base_weights
    assert (tmp_path / "work" / "adapt-1" / "checkpoint-2").is_dir()
    run = json.loads((tmp_path / "work" / "run.json").read_text())
    assert run["settings"]["adapt"]["adapt_lr"] == 2e-3
    assert run["stages"]["superseded"]["adapt"]["settings"]["adapt_lr"] == 1e-3
    assert (tmp_path / "clover" / "model.safetensors").is_file()


def _directory_with(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(text)
    return path


def test_replace_directory_swaps_in_the_new_output_and_leaves_nothing_aside(tmp_path):
    output = _directory_with(tmp_path / "out", "old")
    replace_directory(_directory_with(tmp_path / "staging", "new"), output)
    assert (output / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_directory_puts_the_old_output_back_when_the_swap_fails(tmp_path, monkeypatch):
    output = _directory_with(tmp_path / "out", "old")
    staging = _directory_with(tmp_path / "staging", "new")
    rename = Path.rename

    def failing_rename(self, target):
        if self == staging:
            raise OSError("disk full")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk full"):
        replace_directory(staging, output)
    assert (output / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "staging"]


def test_generate_prints_plain_text_to_a_pipe_without_a_loading_bar(tmp_path):
    """Piped (not a terminal): no ANSI styling, no weight-loading progress bar, the answer and the cost line."""
    prompt = "Sort these numbers in ascending order: 42, 7, 19, 3, 88"
    result = run_script("generate.py", "--no-thinking", "--strategy", "self_speculative", prompt, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b[" not in result.stdout and "Loading weights" not in result.stderr, (result.stdout, result.stderr)
    assert result.stdout.splitlines()[0] == "3, 7, 19, 42, 88", result.stdout
    assert re.fullmatch(r"-- \d+ new tokens, \d+ forwards, .* tok/s", result.stdout.splitlines()[-1])
