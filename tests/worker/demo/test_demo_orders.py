"""The demo model answers whether the picture comes before the question or after it, as a real VLM does: a
multipart job (`vlmq submit`) puts the image first, and a JSON job carries whatever order its client chose."""

from __future__ import annotations

import base64
import io
import random
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from common.infra.settings import DEMO_MODEL, Settings
from tests.conftest import ApiServer
from worker.demo import DEMO_MODEL_DIR
from worker.demo.scoring import HELD_OUT_SEED, messages
from worker.demo.shapes import Sample, samples
from worker.demo.train import batch_inputs, image_first_flags, load_for_training
from worker.inference.model_loader import load_model

N_API = 8  # held-out pictures per layout through the embedded API; the 1,000-question figures are in the docs


def test_the_template_puts_a_turns_text_before_its_images_whatever_the_order() -> None:
    from worker.demo.chat_template import DEMO_CHAT_TEMPLATE

    assert (DEMO_MODEL_DIR / "chat_template.jinja").read_text() == DEMO_CHAT_TEMPLATE  # the committed model's
    processor = load_model(DEMO_MODEL, weights=False).processor

    def render(*turns: object) -> str:
        return processor.apply_chat_template(list(turns), add_generation_prompt=True, tokenize=False)

    text, image = {"type": "text", "text": "What colour is the star?"}, {"type": "image"}
    expected = "<s><|user|>\nWhat colour is the star?<image></s>\n<|assistant|>\n"
    assert render({"role": "user", "content": [text, image]}) == expected
    assert render({"role": "user", "content": [image, text]}) == expected
    # Texts and images keep their own orders; each turn is laid out alone; plain-string turns pass through.
    two = [image, {"type": "text", "text": "A"}, image, {"type": "text", "text": "B"}]
    assert render({"role": "system", "content": "Be brief."}, {"role": "user", "content": two},
                  {"role": "assistant", "content": "red"}, {"role": "user", "content": [image, text]}) == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nAB<image><image></s>\n<|assistant|>\nred</s>\n"
        "<|user|>\nWhat colour is the star?<image></s>\n<|assistant|>\n")


def test_image_first_flags_follow_the_share() -> None:
    assert image_first_flags(random.Random(0), 50, 0.0) == [False] * 50
    assert image_first_flags(random.Random(0), 50, 1.0) == [True] * 50
    flags = image_first_flags(random.Random(0), 1000, 0.5)
    assert 400 < sum(flags) < 600
    assert flags == image_first_flags(random.Random(0), 1000, 0.5)  # reproducible from the stream


def test_messages_put_the_image_where_asked() -> None:
    assert [p["type"] for p in messages("Q?")[0]["content"]] == ["text", "image"]
    assert [p["type"] for p in messages("Q?", image_first=True)[0]["content"]] == ["image", "text"]


def test_a_training_batch_lays_out_each_question_in_its_own_order() -> None:
    loaded = load_for_training(DEMO_MODEL_DIR)  # a template that keeps each question's order
    batch = samples(2, 11)
    inputs = batch_inputs(loaded, batch, [False, True])
    for row, (s, image_first) in enumerate(zip(batch, [False, True], strict=True)):
        ids = inputs["input_ids"][row].tolist()
        question = loaded.tokenizer(s.question, add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(ids)) if ids[i:i + len(question)] == question]
        assert len(starts) == 1, (ids, question)
        images = [i for i, t in enumerate(ids) if t == loaded.image_token_id]
        assert (images[-1] < starts[0]) if image_first else (images[0] > starts[0] + len(question) - 1)
        # Only the answer and its EOS are learnt, whatever the order.
        labels = [t for t in inputs["labels"][row].tolist() if t != -100]
        answer = loaded.tokenizer(s.answer, add_special_tokens=False)["input_ids"]
        assert labels == [*answer, loaded.tokenizer.eos_token_id]


def _png(sample: Sample) -> bytes:
    buf = io.BytesIO()
    sample.image.save(buf, format="PNG")
    return buf.getvalue()


def _json_job(client: httpx.Client, sample: Sample, image_first: bool) -> str:
    url = "data:image/png;base64," + base64.b64encode(_png(sample)).decode()
    parts = [{"type": "text", "text": sample.question}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": parts[::-1] if image_first else parts}], "max_tokens": 8}
    job = client.post("/v1/jobs", json=body).json()
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
        job = client.get(f"/v1/jobs/{job['id']}").json()
    assert job["status"] == "succeeded", job
    return job["result"]["text"].strip()


def test_the_demo_answers_in_every_layout_through_the_api(tmp_path: Path) -> None:
    """Embedded `vlmq api` (auth off) serving the demo model: held-out pictures, asked in each layout."""
    from cli.main import app as cli
    from common.broker.queue import make_celery
    from common.infra.migrate import upgrade
    from worker.context import get_context, set_context
    from worker.embedded import embedded_worker

    held_out = samples(N_API, HELD_OUT_SEED)
    settings = Settings(data_dir=tmp_path / "state", model=DEMO_MODEL, broker_url="memory://")
    upgrade(settings.database_url)
    celery = make_celery(settings)
    got: dict[str, list[str]] = {"vlmq submit (multipart)": [], "JSON, text first": [], "JSON, image first": []}
    try:
        with embedded_worker(celery, settings), ApiServer(settings) as server:
            server.app.state.vlmq.celery = celery  # as `vlmq api` does: one in-memory broker for both
            with httpx.Client(base_url=server.url, timeout=60) as client:
                for i, s in enumerate(held_out):
                    picture = tmp_path / f"{i}.png"
                    picture.write_bytes(_png(s))
                    result = CliRunner().invoke(cli, ["submit", "-i", str(picture), s.question, "--wait",
                                                      "--api-url", server.url])
                    assert result.exit_code == 0, result.output
                    got["vlmq submit (multipart)"].append(result.stdout.strip())
                    got["JSON, text first"].append(_json_job(client, s, image_first=False))
                    got["JSON, image first"].append(_json_job(client, s, image_first=True))
    finally:
        get_context().close()
        set_context(None)
    assert got == {layout: [s.answer for s in held_out] for layout in got}
