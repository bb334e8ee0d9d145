"""Score a demo checkpoint on the held-out questions, with HF `generate` and with the vlmq engine, with the
question before the image and after it.

    python -m worker.demo.evaluate [--model vlmq-demo] [--n 1000] [--dtype bfloat16]

Prints exact match by kind for each, and how many answers the two give alike (in fp32 they must all agree: the
engine is checked token for token against HF `generate`; in bf16 the two round differently, since the engine
attends in fp32 over a bf16 KV cache, so near-ties may go either way and the exact match is what to read).
"""

from __future__ import annotations

import argparse
import time

import torch

from common.infra.settings import DEMO_MODEL
from worker.demo.scoring import HELD_OUT_SEED, MAX_ANSWER_TOKENS, N_HELD_OUT, ORDERS, exact_match, hf_answers, messages
from worker.demo.shapes import Sample, samples
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.inference.generation import GenerationRequest, SamplingParams
from worker.inference.model_loader import LoadedModel, load_model


def engine_answers(loaded: LoadedModel, batch: list[Sample], image_first: bool = False) -> list[str]:
    """The engine's answers; it installs its paged attention in `loaded`, which HF `generate` cannot run after."""
    engine = Engine(loaded, EngineConfig(num_kv_blocks=1024, block_size=16))
    results = engine.generate([GenerationRequest(f"q{i}", messages(s.question, image_first), [s.image],
                                                 SamplingParams(max_tokens=MAX_ANSWER_TOKENS))
                               for i, s in enumerate(batch)])
    return [r.text.strip() for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--n", type=int, default=N_HELD_OUT)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    held_out = samples(args.n, HELD_OUT_SEED)
    for order, image_first in ORDERS.items():
        # A fresh copy per order: the engine installs its paged attention in the model it drives.
        loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
        answers = {}
        for name, run in (("HF generate", hf_answers), ("vlmq engine", engine_answers)):
            started = time.perf_counter()
            answers[name] = got = run(loaded, held_out, image_first)
            seconds = time.perf_counter() - started
            print(f"{order}, {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in exact_match(held_out, got).items())
                  + f" ({len(held_out) / seconds:.0f} questions/s)")
        same = sum(a == b for a, b in zip(answers["HF generate"], answers["vlmq engine"], strict=True))
        print(f"{order}: engine answers equal to HF generate's: {same}/{len(held_out)}")


if __name__ == "__main__":
    main()
