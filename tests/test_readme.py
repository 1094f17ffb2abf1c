"""The README's Python snippets run as written: in a fresh process, stdin closed, from a scratch directory with the
repository's models/ reachable, finishing without a remote-code prompt or a model-type warning."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SNIPPETS = {
    heading: textwrap.dedent(code)
    for heading, code in re.findall(r"^## ([^\n]+)\n(?:(?!^## ).)*?```python\n(.*?)```", README, re.S | re.M)
}
SILENT = ("Do you wish to run the custom code", "You are using a model of type")
QUANTIZED = "Running Clover-35B-A3B"
FINE_TUNING = "Fine-tuning"
FOUR_BIT = 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")'
SORTED = "3, 7, 19, 42, 88"  # the quantization snippet's question, answered


def test_readme_has_the_snippets_this_checks():
    assert "Using it from Transformers" in SNIPPETS, sorted(SNIPPETS)
    assert FOUR_BIT in SNIPPETS.get(QUANTIZED, ""), sorted(SNIPPETS)


def printed_block(heading: str) -> str:
    """The ```text block that follows the section's Python snippet: what the README says it prints."""
    section = README.split(f"## {heading}\n", 1)[1]
    return re.search(r"```python\n.*?```\s*```text\n(.*?)```", section, re.S).group(1)


def test_readme_transformers_snippet_prints_what_the_readme_shows_without_prompts_or_warnings():
    heading = "Using it from Transformers"
    result = run_python("-c", SNIPPETS[heading], cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for text in SILENT:
        assert text not in output, output[-3000:]
    assert result.stdout == printed_block(heading), output[-3000:]


def test_readme_trl_snippet_trains_and_saves_a_loadable_model(tmp_path):
    pytest.importorskip("trl")
    code = (
        SNIPPETS[FINE_TUNING]
        .replace("max_steps=150", "max_steps=2")
        .replace('"my-clover"', repr(str(tmp_path / "out")))
    )
    saved = str(tmp_path / "out")
    code += f"\nprint(type(AutoModelForCausalLM.from_pretrained({saved!r}, trust_remote_code=True)).__name__)"
    result = run_python("-c", code, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "CloverForBlockDiffusion", output[-3000:]


@pytest.mark.parametrize("bits", [4, 8])
def test_readme_quantization_snippet_answers_right_in_eval_mode_and_its_save_reloads(bits, tmp_path):
    """The 4-bit recipe as written (8-bit: its commented alternative) on the shipped model, in eval mode, where
    bitsandbytes' CPU kernel repacks every Linear4bit; then the pre-quantized save, reloaded with no config."""
    pytest.importorskip("bitsandbytes")
    saved = tmp_path / "saved"
    code = SNIPPETS[QUANTIZED].replace('"clover-nf4"', repr(str(saved)))
    if bits == 8:
        code = code.replace(FOUR_BIT, "BitsAndBytesConfig(load_in_8bit=True)")
    code += textwrap.dedent(f"""
        again = AutoModelForCausalLM.from_pretrained({str(saved)!r}, trust_remote_code=True).eval()
        out = again.generate(**inputs, max_new_tokens=32)
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    """)
    result = run_python("-c", code, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert result.stdout.split("\n")[:2] == [SORTED, SORTED], output[-3000:]
