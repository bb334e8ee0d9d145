"""Writes an OpenAI batch input file of the demo task: shape pictures and questions, with the expected answer.

    python examples/make_jobs.py [--n 200] [--seed 2026] [-o examples/shapes.jsonl]

Each line asks the bundled demo model (`vlmq-demo`) one question about one 96 px picture from
worker/demo/shapes.py, sent inline as a data: URL; the line's `metadata.answer` carries the right answer, which
`vlmq run` scores its output against. The seed is not one the demo model was trained or evaluated on.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from pathlib import Path

from common.infra.settings import DEMO_MODEL
from worker.demo.shapes import Sample, samples

EXAMPLE_SEED = 2026


def batch_line(index: int, sample: Sample) -> dict:
    buf = io.BytesIO()
    sample.image.save(buf, format="PNG", optimize=True)
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {
        "model": DEMO_MODEL,
        # The question first, then the picture: the order the demo model was trained on.
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": sample.question},
            {"type": "image_url", "image_url": {"url": data_url}},
        ]}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return {"custom_id": f"shapes-{index:04d}", "method": "POST", "url": "/v1/chat/completions", "body": body,
            "metadata": {"answer": sample.answer, "kind": sample.kind}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=EXAMPLE_SEED)
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("shapes.jsonl"))
    args = parser.parse_args()
    with args.output.open("w", encoding="utf-8") as out:
        for i, sample in enumerate(samples(args.n, args.seed)):
            out.write(json.dumps(batch_line(i, sample)) + "\n")


if __name__ == "__main__":
    main()
