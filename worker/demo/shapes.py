"""Synthetic visual questions for the bundled demo model: images of 1-4 coloured shapes, and short,
deterministic answers about them.

Kinds of question: the colour of a shape, the shape of a colour, how many shapes, whether a shape is in the left
or the right half, and the colour and shape of the biggest one. Every sample comes from a seeded random.Random,
so a seed gives the same image and question everywhere.

An image is 96 px, a 4 x 4 grid of 24 px cells; each shape sits at the centre of one cell, at a random size. The
demo model's vision tower sees the image in 24 px patches, one per cell: a shape is then always whole inside one
patch, at one place in it, which is what lets a model this small, trained from scratch on two CPU cores, learn
to tell the shapes apart (with shapes anywhere in their cell, it learnt colours but hardly told shapes apart).
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
GRID = 4
CELL = 24
IMAGE_SIZE = GRID * CELL
MIN_RADIUS, MAX_RADIUS = 5, 10
LARGEST_MARGIN = 3  # the biggest shape is at least this much wider (radius, px) than the next, or nobody asks


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    cx: int
    cy: int
    radius: int

    @property
    def column(self) -> int:
        return self.cx // CELL

    @property
    def cell(self) -> int:
        """The grid cell (row-major, as the vision tower orders its patches) the shape sits in."""
        return (self.cy // CELL) * GRID + self.cx // CELL


@dataclass(frozen=True)
class Sample:
    image: Image.Image
    question: str
    answer: str
    kind: str
    items: tuple[Item, ...] = ()  # the scene drawn, for training signals beyond the answer


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


def _place(rng: random.Random, cell: int) -> tuple[int, int, int]:
    """The centre of grid cell `cell` and a random radius."""
    row, column = divmod(cell, GRID)
    return column * CELL + CELL // 2, row * CELL + CELL // 2, rng.randint(MIN_RADIUS, MAX_RADIUS)


def scene(rng: random.Random) -> list[Item]:
    """1-4 shapes in distinct cells; no two share both shape and colour, so every question names one object."""
    n = rng.randint(1, 4)
    pairs = rng.sample([(s, c) for s in SHAPES for c in COLOURS], n)
    cells = rng.sample(range(GRID * GRID), n)
    return [Item(s, c, *_place(rng, cell)) for (s, c), cell in zip(pairs, cells, strict=True)]


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
        if not unique:
            return None
        item = rng.choice(unique)
        return f"Is the {item.shape} on the left or the right?", "left" if item.column < GRID // 2 else "right"
    if kind == "largest":
        ordered = sorted(items, key=lambda i: i.radius, reverse=True)
        if len(ordered) > 1 and ordered[0].radius - ordered[1].radius < LARGEST_MARGIN:
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
            return Sample(draw(items), qa[0], qa[1], chosen, tuple(items))


def samples(n: int, seed: int) -> list[Sample]:
    """`n` samples, kinds in turn, reproducible from `seed`."""
    rng = random.Random(seed)
    return [sample(rng, KINDS[i % len(KINDS)]) for i in range(n)]


def corpus() -> list[str]:
    """Every question template and answer word, for training the demo tokenizer."""
    lines = ["How many shapes are there?", "Describe the biggest shape."]
    lines += [f"What colour is the {s}?" for s in SHAPES] + [f"What shape is the {c} one?" for c in COLOURS]
    lines += [f"Is the {s} on the left or the right?" for s in SHAPES]
    lines += [f"{c} {s}" for c in COLOURS for s in SHAPES] + list(NUMBERS) + ["left", "right"]
    return lines
