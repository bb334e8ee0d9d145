"""Writes examples/jobs.jsonl: an OpenAI batch input file of small shape pictures and questions about them.

    python examples/make_jobs.py [--n 24] [--seed 0] [-o examples/jobs.jsonl]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")


def picture(rng: random.Random) -> tuple[bytes, str, str]:
    img = Image.new("RGB", (64, 64), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    color_name, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    x, y, r = rng.randint(16, 48), rng.randint(16, 48), rng.randint(8, 14)
    box = (x - r, y - r, x + r, y + r)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color_name])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color_name])
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLORS[color_name])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), color_name, shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("jobs.jsonl"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with args.output.open("w", encoding="utf-8") as out:
        for i in range(args.n):
            data, color, shape = picture(rng)
            question = rng.choice(["What colour is the shape?", "What shape is this?", "Describe the image."])
            data_url = "data:image/png;base64," + base64.b64encode(data).decode()
            body = {
                "model": "tiny-llava",
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url}},
                    {"type": "text", "text": question},
                ]}],
                "max_tokens": 16,
            }
            line = {"custom_id": f"shape-{i:03d}", "method": "POST", "url": "/v1/chat/completions", "body": body,
                    "metadata": {"answer_colour": color, "answer_shape": shape}}
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
