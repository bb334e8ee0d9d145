"""Summarise py-spy's collapsed stacks (`--format raw`): the share of samples in which each function, or each
of our own modules, appears, so a profile can be read without a flame-graph viewer.

    .venv/bin/python bench/flat_profile.py /tmp/prof-tiny-text.worker.txt [--top 40]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def summarise(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    total, inclusive, leaf = 0, Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        seen = set()
        frames = stack.split(";")
        for frame in frames:
            m = _FRAME.match(frame)
            name = f"{m['func']} ({Path(m['file']).name})" if m else frame
            if name not in seen:
                seen.add(name)
                inclusive[name] += n
        m = _FRAME.match(frames[-1])
        leaf[f"{m['func']} ({Path(m['file']).name})" if m else frames[-1]] += n
    return total, inclusive, leaf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    total, inclusive, leaf = summarise(args.profile)
    print(f"{total} samples")
    print("inclusive (share of samples in which the function is on the stack):")
    for name, n in inclusive.most_common(args.top):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print("self (share of samples in which it is the running frame):")
    for name, n in leaf.most_common(args.top // 2):
        print(f"  {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
