"""Synthetic visual questions for the bundled demo model: images of 1-4 coloured shapes, and short,
deterministic answers about them.

Kinds of question: the colour of a shape, the shape of a colour, how many shapes, whether one shape is left or
right of another, and a one-word description of the whole image's largest shape. Every sample comes from a
seeded random.Random, so a seed gives the same image and question everywhere. Images are small (64 px): the
demo model's vision tower sees 8x8 patches of 8 px.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 210, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "star")
NUMBERS = ("zero", "one", "two", "three", "four")
KINDS = ("colour", "shape", "count", "position", "largest")
IMAGE_SIZE = 64


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    cx: int
    cy: int
    radius: int


@dataclass(frozen=True)
class Sample:
    image: Image.Image
    question: str
    answer: str
    kind: str


def _points(item: Item) -> list[tuple[float, float]]:
    r, cx, cy = item.radius, item.cx, item.cy
    if item.shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if item.shape == "star":
        return [(cx + (r if k % 2 == 0 else r * 0.45) * math.cos(-math.pi / 2 + k * math.pi / 5),
                 cy + (r if k % 2 == 0 else r * 0.45) * math.sin(-math.pi / 2 + k * math.pi / 5)) for k in range(10)]
    raise ValueError(item.shape)


def draw(items: list[Item], background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    pen = ImageDraw.Draw(image)
    for item in items:
        fill = COLOURS[item.colour]
        box = (item.cx - item.radius, item.cy - item.radius, item.cx + item.radius, item.cy + item.radius)
        if item.shape == "circle":
            pen.ellipse(box, fill=fill)
        elif item.shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon(_points(item), fill=fill)
    return image


def _place(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    """n non-overlapping circles (cx, cy, r) inside the image, with distinct x so left/right is clear."""
    for _ in range(1000):
        spots: list[tuple[int, int, int]] = []
        for _ in range(n):
            r = rng.randint(6, 11)
            cx, cy = rng.randint(r + 1, IMAGE_SIZE - r - 2), rng.randint(r + 1, IMAGE_SIZE - r - 2)
            if all(math.hypot(cx - x, cy - y) > r + q + 2 and abs(cx - x) > 4 for x, y, q in spots):
                spots.append((cx, cy, r))
        if len(spots) == n:
            return spots
    raise RuntimeError("could not place the shapes")


def scene(rng: random.Random) -> list[Item]:
    """1-4 shapes; no two share both shape and colour, so every question names one object."""
    n = rng.randint(1, 4)
    pairs = rng.sample([(s, c) for s in SHAPES for c in COLOURS], n)
    return [Item(s, c, cx, cy, r) for (s, c), (cx, cy, r) in zip(pairs, _place(rng, n), strict=True)]


def _unique_by(items: list[Item], attribute: str) -> list[Item]:
    """The items that alone have their value of `attribute` (so naming that value names them)."""
    return [i for i in items if sum(getattr(j, attribute) == getattr(i, attribute) for j in items) == 1]


def ask(rng: random.Random, items: list[Item], kind: str) -> tuple[str, str] | None:
    """A question of `kind` about `items` with its one right answer, or None when the scene cannot pose it."""
    if kind == "count":
        return "How many shapes are there?", NUMBERS[len(items)]
    if kind in ("colour", "shape"):
        unique = _unique_by(items, "shape" if kind == "colour" else "colour")
        if not unique:
            return None
        item = rng.choice(unique)
        if kind == "colour":
            return f"What colour is the {item.shape}?", item.colour
        return f"What shape is the {item.colour} one?", item.shape
    if kind == "position":
        unique = _unique_by(items, "shape")
        if len(unique) < 2:
            return None
        a, b = rng.sample(unique, 2)
        return f"Is the {a.shape} left or right of the {b.shape}?", "left" if a.cx < b.cx else "right"
    if kind == "largest":
        ordered = sorted(items, key=lambda i: i.radius, reverse=True)
        if len(ordered) > 1 and ordered[0].radius - ordered[1].radius < 3:
            return None  # too close to call by eye
        return "Describe the biggest shape.", f"{ordered[0].colour} {ordered[0].shape}"
    raise ValueError(kind)


def sample(rng: random.Random, kind: str | None = None) -> Sample:
    """One image and question (of `kind`, or of a random kind the scene can pose)."""
    while True:
        items = scene(rng)
        chosen = kind or rng.choice(KINDS)
        qa = ask(rng, items, chosen)
        if qa is not None:
            return Sample(draw(items), qa[0], qa[1], chosen)


def samples(n: int, seed: int) -> list[Sample]:
    """`n` samples, kinds in turn, reproducible from `seed`."""
    rng = random.Random(seed)
    return [sample(rng, KINDS[i % len(KINDS)]) for i in range(n)]
