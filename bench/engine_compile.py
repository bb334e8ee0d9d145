"""The engine eager against its decoder layers compiled: `bench/engine_ab.py --pair compile` (kept under its
first name, which docs/benchmarks.md's commands use).

    .venv/bin/python bench/engine_compile.py --models small --dtypes float32,bfloat16 --rounds 4
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_ab import main

if __name__ == "__main__":
    main(default_pair="compile")
