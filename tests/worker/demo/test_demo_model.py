"""The bundled demo model (worker/demo/model) really sees.

Held-out questions it was never trained on, nor picked on, are answered right by HF `generate`; vlmq gives the
same answers through its engine and through `vlmq run` with no --model (the demo model is the default), whose
summary scores them against the answers the example file carries.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.infra.settings import DEMO_MODEL
from examples.make_jobs import EXAMPLE_SEED, batch_line
from worker.demo import DEMO_MODEL_DIR
from worker.demo.evaluate import engine_answers
from worker.demo.scoring import HELD_OUT_SEED, N_HELD_OUT, exact_match, hf_answers
from worker.demo.shapes import KINDS, Sample, samples
from worker.inference.model_loader import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "shapes.jsonl"
N_CHECKED = 300  # of the 1,000 held-out questions the model is scored on (docs/benchmarks.md)


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return load_model(DEMO_MODEL)


@pytest.fixture(scope="module")
def held_out() -> list[Sample]:
    return samples(N_HELD_OUT, HELD_OUT_SEED)[:N_CHECKED]


@pytest.fixture(scope="module")
def reference(demo: LoadedModel, held_out: list[Sample]) -> list[str]:
    return hf_answers(demo, held_out)


def test_the_checkpoint_is_small_and_loads_by_name(demo: LoadedModel) -> None:
    size = sum(f.stat().st_size for f in DEMO_MODEL_DIR.iterdir())
    assert size <= 20 * 2**20, f"the bundled model is {size / 2**20:.1f} MiB"
    assert demo.name == DEMO_MODEL
    assert type(demo.model).__name__ == "LlavaForConditionalGeneration"


def test_hf_generate_answers_held_out_questions(held_out: list[Sample], reference: list[str]) -> None:
    scores = exact_match(held_out, reference)
    assert scores["all"] >= 0.95, scores
    assert all(scores[kind] >= 0.85 for kind in KINDS), scores


def test_the_engine_gives_the_same_answers(held_out: list[Sample], reference: list[str]) -> None:
    # A copy of its own: the engine installs its paged attention in the model it drives.
    assert engine_answers(load_model(DEMO_MODEL), held_out) == reference


def test_the_example_file_is_what_make_jobs_writes() -> None:
    lines = EXAMPLE.read_text().splitlines()
    assert lines == [json.dumps(batch_line(i, s)) for i, s in enumerate(samples(len(lines), EXAMPLE_SEED))]


def test_vlmq_run_with_the_default_model_scores_the_example(demo: LoadedModel, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    env.update({"VLMQ_DATA_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "2", "NO_COLOR": "1"})
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "cli.main", "run", str(EXAMPLE), "-o", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    example = samples(len(lines), EXAMPLE_SEED)
    got = [line["response"]["body"]["choices"][0]["message"]["content"] for line in lines]
    assert got == hf_answers(demo, example)
    assert all(line["response"]["body"]["model"] == DEMO_MODEL for line in lines)
    right = sum(g == s.answer for g, s in zip(got, example, strict=True))
    summary = re.search(r"accuracy: (\d+)/(\d+) answers match", proc.stderr)
    assert summary is not None, proc.stderr[-2000:]
    assert (int(summary[1]), int(summary[2])) == (right, len(lines))
    assert right / len(lines) >= 0.95
