"""The README's Python snippets run as written: in a fresh process, stdin closed, from a scratch directory with the
repository's models/ reachable, finishing without a remote-code prompt or a model-type warning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SNIPPETS = {
    heading: code
    for heading, code in re.findall(r"^## ([^\n]+)\n(?:(?!^## ).)*?```python\n(.*?)```", README, re.S | re.M)
}
SILENT = ("Do you wish to run the custom code", "You are using a model of type")


def test_readme_has_the_snippets_this_checks():
    assert "Using it from Transformers" in SNIPPETS, sorted(SNIPPETS)


@pytest.mark.parametrize("heading", ["Using it from Transformers"])
def test_readme_snippet_runs_as_written_without_prompts_or_warnings(heading):
    result = run_python("-c", SNIPPETS[heading], cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for text in SILENT:
        assert text not in output, output[-3000:]
    assert result.stdout.strip(), "the snippet printed nothing"
