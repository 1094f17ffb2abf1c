"""lm-evaluation-harness on Clover: the repository's `clover_demo` tasks hold eval_demo.py's problems, and lm-eval's
`hf` model (Clover's generate for generate_until, the causal forward for loglikelihood) scores them as eval_demo.py
does. Skipped without lm-eval."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from clover.demo.evaluation import evaluate  # noqa: E402
from clover.demo.tasks import FAMILIES, check_reply, generate_examples  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "clover-tiny-demo"
TASKS = REPO / "lm_eval_tasks"
LIMIT = 4  # problems per family in the in-process run


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS))


def test_the_demo_tasks_hold_eval_demos_problems_in_its_order(task_manager):
    tasks = lm_eval.tasks.get_task_dict([f"clover_demo_{family}" for family in FAMILIES], task_manager)
    problems = generate_examples(50 * len(FAMILIES), seed=12345)  # eval_demo.py's defaults
    for family in FAMILIES:
        docs = list(tasks[f"clover_demo_{family}"].test_docs())
        expected = [example.expected for example in problems if example.family == family]
        assert [doc["expected"] for doc in docs] == expected


def test_lm_eval_in_process_scores_as_eval_demo_does(task_manager):
    """generate_until through lm-eval's hf model (batch 4) and the same problems through Clover's generate (batch
    1, as eval_demo.py decodes them) give the same replies' verdicts; the loglikelihood task runs on the causal
    forward. About 10 s."""
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={DEMO},trust_remote_code=True",
        tasks=[*(f"clover_demo_{family}" for family in FAMILIES), "clover_demo_choice"],
        task_manager=task_manager,
        batch_size=4,
        device="cpu",
        limit=LIMIT,
        log_samples=True,
    )
    model = AutoModelForCausalLM.from_pretrained(DEMO, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO, trust_remote_code=True)
    problems = generate_examples(50 * len(FAMILIES), seed=12345)
    for family in FAMILIES:
        examples = [example for example in problems if example.family == family][:LIMIT]
        expected = evaluate(model, tokenizer, examples, 0.95, 1, 192)[family]["correct"]
        samples = results["samples"][f"clover_demo_{family}"]
        assert sum(int(sample["exact_match"]) for sample in samples) == expected, family
        for sample, example in zip(samples, examples, strict=True):  # lm-eval's reply, checked by eval_demo's rule
            assert sample["exact_match"] == float(check_reply(example, sample["filtered_resps"][0]))
    assert results["results"]["clover_demo_choice"]["acc,none"] >= 0.5
