"""The bundled demo model: a small LLaVA trained here on synthetic shape questions (worker/demo/train.py)."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).with_name("model")
