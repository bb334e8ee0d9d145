"""Image jobs prepared in processes of their own (worker/jobs/prepare_pool.py) give the engine exactly what the job's
thread would, refuse the same inputs with the same errors, and outlive a process that dies."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from common.images.decode import ImageError
from common.images.pack import PackedImage
from common.infra.settings import Settings
from common.infra.storage import LocalObjectStore, ObjectNotFound, image_key
from worker.engine.families import get_family
from worker.engine.model_runner import PreparedInput, prepare_input
from worker.inference.batcher import BatchingGenerator
from worker.inference.generation import InputError
from worker.inference.model_loader import load_model
from worker.jobs.image_reader import ImageReader, ImageRef
from worker.jobs.prepare_pool import PreparePool
from worker.jobs.request import fetch_images, generation_request


def _image(size: tuple[int, int], colour: tuple[int, int, int], fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt)
    return buf.getvalue()


def _request(*parts: dict[str, Any], system: str | None = None, seed: int | None = None) -> dict[str, Any]:
    messages = [{"role": "user", "content": list(parts)}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
    return {"messages": messages,
            "sampling": {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 3, "seed": seed, "stop": ["."]}}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pool-store")


@pytest.fixture(scope="module")
def settings(tiny_llava_path: Path, store_dir: Path) -> Settings:
    return Settings(model=str(tiny_llava_path), storage_backend="local", storage_dir=store_dir)


@pytest.fixture(scope="module")
def pool(settings: Settings) -> Iterator[PreparePool]:
    pool = PreparePool(settings, 2)
    yield pool
    pool.close()


def _in_thread(settings: Settings, job_id: str, request: dict[str, Any], priority: int) -> PreparedInput:
    front = load_model(settings.model, weights=False)
    store = LocalObjectStore(settings.storage_dir)  # type: ignore[arg-type]
    return prepare_input(front, get_family(front.model), generation_request(
        job_id, request, priority, settings, fetch_images(request, settings, ImageReader(store).read), "acme"))


def test_the_pool_prepares_exactly_what_the_jobs_thread_does(pool: PreparePool, settings: Settings,
                                                              store_dir: Path) -> None:
    store = LocalObjectStore(store_dir)
    store.put(image_key("red"), _image((64, 48), (200, 10, 30), "PNG"))
    store.put(image_key("blue"), _image((30, 90), (10, 20, 220), "JPEG"))
    request = _request({"type": "image", "image_id": "red"}, {"type": "text", "text": "and this one?"},
                       {"type": "image", "image_id": "blue"}, system="Be brief.", seed=7)

    got = pool.prepare("job-1", request, 3, "acme")
    want = _in_thread(settings, "job-1", request, 3)

    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.images == want.images and len(got.images) == 2
    assert len(got.image_inputs) == 2
    for mine, theirs in zip(got.image_inputs, want.image_inputs, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[key], theirs[key]) for key in mine)
    assert got.request.request_id == "job-1" and got.request.priority == 3 and got.request.cache_salt == "acme"
    assert got.request.sampling == want.request.sampling
    assert got.request.messages == want.request.messages
    assert got.request.images == []  # the pixels travel in image_inputs, not as decoded images


def test_the_pool_refuses_what_the_jobs_thread_refuses(pool: PreparePool, settings: Settings,
                                                       store_dir: Path) -> None:
    store = LocalObjectStore(store_dir)
    store.put(image_key("cut"), _image((64, 64), (1, 2, 3), "PNG")[:-40])
    cut = _request({"type": "image", "image_id": "cut"}, {"type": "text", "text": "what is it"})
    with pytest.raises(ImageError) as in_pool:
        pool.prepare("job-2", cut, 0, "acme")
    with pytest.raises(ImageError) as in_thread:
        _in_thread(settings, "job-2", cut, 0)
    assert str(in_pool.value) == str(in_thread.value) != ""

    missing = _request({"type": "image", "image_id": "never-stored"}, {"type": "text", "text": "hi"})
    with pytest.raises(ObjectNotFound) as gone:
        pool.prepare("job-3", missing, 0, "acme")
    assert gone.value.args[0] == image_key("never-stored")

    # A user who types the placeholder shifts no image: the job is refused, from the pool as from the thread.
    store.put(image_key("ok"), _image((32, 32), (9, 9, 9), "PNG"))
    typed = _request({"type": "image", "image_id": "ok"}, {"type": "text", "text": "<image> and <image>"})
    with pytest.raises(InputError, match="placeholder"):
        pool.prepare("job-4", typed, 0, "acme")


def test_a_process_that_dies_fails_the_jobs_it_held_and_a_new_pool_takes_the_next(settings: Settings,
                                                                                  store_dir: Path) -> None:
    store = LocalObjectStore(store_dir)
    store.put(image_key("green"), _image((40, 40), (0, 200, 0), "PNG"))
    request = _request({"type": "image", "image_id": "green"}, {"type": "text", "text": "colour?"})
    before = set(multiprocessing.active_children())
    pool = PreparePool(settings, 1)
    try:
        expected = pool.prepare("job-5", request, 0, "acme").prompt_token_ids
        started = [p for p in multiprocessing.active_children() if p not in before]
        assert len(started) == 1
        os.kill(started[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
        started[0].join(10)
        with pytest.raises(BrokenProcessPool):
            pool.prepare("job-6", request, 0, "acme")
        assert pool.num_replaced == 1
        assert pool.prepare("job-7", request, 0, "acme").prompt_token_ids == expected
    finally:
        pool.close()
    assert not [p for p in multiprocessing.active_children() if p not in before]  # closed: none left behind


def test_a_pool_is_built_for_the_paged_engine_only(tiny_llava_path: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from worker.context import make_backend, prepare_pool

    hf = Settings(model=str(tiny_llava_path), backend="hf", prepare_processes=2, storage_backend="local",
                  storage_dir=tmp_path)
    generator = make_backend(load_model(str(tiny_llava_path)), hf)
    try:
        assert isinstance(generator, BatchingGenerator)
        assert prepare_pool(hf, generator) is None
        assert "paged engine only" in caplog.text
    finally:
        generator.close()
    assert prepare_pool(Settings(model=str(tiny_llava_path)), generator) is None  # 0: in the job's thread


def test_the_pools_processes_follow_a_worker_killed_outright(settings: Settings) -> None:
    script = (
        "import multiprocessing, sys, time\n"
        "from common.infra.settings import Settings\n"
        "from worker.jobs.prepare_pool import PreparePool\n"
        f"pool = PreparePool(Settings.model_validate_json({settings.model_dump_json()!r}), 2)\n"
        "print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)\n"
        "time.sleep(300)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[3])
    try:
        assert worker.stdout is not None
        children = [int(pid) for pid in worker.stdout.readline().split()]
        assert len(children) >= 2  # the pool's processes (and multiprocessing's resource tracker)
        assert all(_alive(pid) for pid in children)
    finally:
        worker.kill()
        worker.wait(10)
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_images_read_for_the_chunk_travel_to_the_pool(pool: PreparePool, settings: Settings) -> None:
    """A chunk's packed images, read once by the chunk runner, go along to the pool process: nothing is read
    from storage there (this picture is in no store at all)."""
    picture = _image((40, 30), (90, 200, 40), "PNG")
    sha = hashlib.sha256(picture).hexdigest()
    part = {"type": "image", "image_id": sha, "pack": "packs/nowhere", "offset": 0, "size": len(picture)}
    request = _request(part, {"type": "text", "text": "what colour?"})
    got = pool.prepare("job-4", request, 0, "acme", {ImageRef(sha, PackedImage.of_part(part)): picture})
    assert len(got.image_inputs) == 1
    with pytest.raises(ObjectNotFound):  # without them, the process reads the pack, which is not there
        pool.prepare("job-5", request, 0, "acme")
