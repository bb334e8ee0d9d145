"""A copy of a transformers-5 LLaVA checkpoint with the weight names vLLM expects.

transformers 5 saves the CLIP tower as `vision_tower.*` (or `model.vision_tower.*`); vLLM's LLaVA loads
`vision_tower.vision_model.*`. Only the safetensors keys change; config, tokenizer and processor are copied.

    python bench/peers/convert.py SRC DST
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file


def rename(key: str) -> str:
    key = re.sub(r"^model\.", "", key)  # transformers 5 nests the towers under `model.`
    if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        key = "vision_tower.vision_model." + key.removeprefix("vision_tower.")
    if key.startswith("lm_head."):
        key = "language_model." + key
    if key.startswith("language_model.") and not key.startswith(("language_model.model.",
                                                                  "language_model.lm_head.")):
        key = "language_model.model." + key.removeprefix("language_model.")
    return key


def convert(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({rename(k): v.contiguous() for k, v in tensors.items()}, dst / shard.name,
                  metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        import json

        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        (dst / index.name).write_text(json.dumps(data))
    return dst


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(sys.argv[2])
