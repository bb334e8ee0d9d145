"""The demo task generator: reproducible from a seed, every kind of question, answers true of the image."""

from __future__ import annotations

import random

from worker.demo.shapes import CELL, COLOURS, GRID, IMAGE_SIZE, KINDS, NUMBERS, SHAPES, ask, draw, samples, scene


def test_the_same_seed_gives_the_same_samples() -> None:
    a, b = samples(30, seed=7), samples(30, seed=7)
    assert [(s.question, s.answer) for s in a] == [(s.question, s.answer) for s in b]
    assert all(x.image.tobytes() == y.image.tobytes() for x, y in zip(a, b, strict=True))
    assert [(s.question, s.answer) for s in samples(30, seed=8)] != [(s.question, s.answer) for s in a]


def test_every_kind_is_asked_with_short_answers() -> None:
    batch = samples(200, seed=1)
    assert {s.kind for s in batch} == set(KINDS)
    assert all(1 <= len(s.answer.split()) <= 2 for s in batch)


def test_answers_are_true_of_the_drawn_scene() -> None:
    rng = random.Random(3)
    for _ in range(300):
        items = scene(rng)
        image = draw(items)
        assert len({(i.shape, i.colour) for i in items}) == len(items)
        for item in items:  # each shape is drawn in its colour at its centre
            assert image.getpixel((item.cx, item.cy)) == COLOURS[item.colour]
        # one shape per cell of the grid, whole inside it: the vision tower sees each cell as one patch
        assert len({i.cell for i in items}) == len(items)
        for item in items:
            row, column = divmod(item.cell, GRID)
            assert column * CELL < item.cx - item.radius and item.cx + item.radius < (column + 1) * CELL
            assert row * CELL < item.cy - item.radius and item.cy + item.radius < (row + 1) * CELL
        assert ask(rng, items, "count") == ("How many shapes are there?", NUMBERS[len(items)])
        colour = ask(rng, items, "colour")
        if colour is not None:
            shape = colour[0].removeprefix("What colour is the ").removesuffix("?")
            assert [i.colour for i in items if i.shape == shape] == [colour[1]]
        position = ask(rng, items, "position")
        if position is not None:
            shape = position[0].removeprefix("Is the ").removesuffix(" on the left or the right?")
            [x] = [i.cx for i in items if i.shape == shape]
            assert position[1] == ("left" if x < IMAGE_SIZE / 2 else "right")
        largest = ask(rng, items, "largest")
        if largest is not None:
            colour_name, shape_name = largest[1].split()
            biggest = max(items, key=lambda i: i.radius)
            assert (biggest.colour, biggest.shape) == (colour_name, shape_name) and shape_name in SHAPES
