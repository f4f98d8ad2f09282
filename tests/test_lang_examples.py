"""Every language example in examples/ runs to completion on the default model.

Each runs as a subprocess against the session's server (`--url`), so the model loads once; one
more run checks the in-process Engine path an example takes without `--url`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "quickstart.py")

# A line each example must print when it worked (a cheap check that it got past its main work).
EXPECTED_OUTPUT = {
    "few_shot_qa.py": "cached tokens",
    "multi_turn_chat.py": "assistant:",
    "tree_of_thought.py": "branch 2:",
    "skeleton_of_thought.py": "Point 2, explained:",
    "react_agent.py": "Action:",
    "llm_judge.py": "Overall:",
    "json_extraction.py": "extract_with_schema:",
    "parallel_summarization.py": "->",
    "openai_speculative.py": "num_api_spec_tokens=48: API calls",
    "tool_agent.py": "called get_weather(",
}


def run_example(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_example_is_covered():
    assert set(EXAMPLES) == set(EXPECTED_OUTPUT)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_against_a_server(name, sglite_server):
    result = run_example(name, "--url", sglite_server.url)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    assert EXPECTED_OUTPUT[name] in result.stdout, result.stdout


@pytest.mark.slow
def test_example_runs_in_process():
    result = run_example("react_agent.py")
    assert result.returncode == 0, f"failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    assert EXPECTED_OUTPUT["react_agent.py"] in result.stdout
