"""A text-only prompt through worker/inference/preprocess.encode_prompt, by the tokenizer alone (where the load-time
probe allows it: LoadedModel.text_by_tokenizer) against the processor, side by side on the same loaded model, for
each family's tiny checkpoint. CPU per prompt (the job thread's own), medians of --repeats, alternating.

    .venv/bin/python bench/prepare.py [--prompts 300] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine import cpu_name  # noqa: E402

from tests.tiny_families import FAMILIES, build_tiny  # noqa: E402
from worker.inference.generation import GenerationRequest  # noqa: E402
from worker.inference.model_loader import LoadedModel, load_model  # noqa: E402
from worker.inference.preprocess import encode_prompt  # noqa: E402

PROMPT = "Describe the picture in one short sentence: the shapes, their colours and where they are."


def cpu_per_prompt(loaded: LoadedModel, prompts: int) -> float:
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    requests = [GenerationRequest(request_id=f"r{i}", messages=messages, images=[]) for i in range(prompts)]
    start = time.thread_time()
    for req in requests:
        encode_prompt(loaded, req)
    return (time.thread_time() - start) / prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}")
    print(f"{'family':<14} {'probe':>6} {'processor ms':>13} {'tokenizer ms':>13} {'speed-up':>9}")
    with tempfile.TemporaryDirectory() as work:
        for family in FAMILIES:
            loaded = load_model(str(build_tiny(Path(work) / family, family)), weights=False)
            ways = {"processor": replace(loaded, text_by_tokenizer=False), "tokenizer": loaded}
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way, model in ways.items():
                    times[way].append(1000 * cpu_per_prompt(model, args.prompts))
            by = {way: statistics.median(values) for way, values in times.items()}
            # Where the probe refused the tokenizer alone, both ways are the processor.
            print(f"{family:<14} {'yes' if loaded.text_by_tokenizer else 'no':>6} {by['processor']:>13.3f} "
                  f"{by['tokenizer']:>13.3f} {by['processor'] / by['tokenizer']:>8.2f}x")


if __name__ == "__main__":
    main()
