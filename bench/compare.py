"""vlmq against its peers and against the machine, side by side in one run: the same jobs, the same checkpoint,
greedy, the same dtype (fp32 unless --dtype says otherwise), the same max_tokens.

    .venv/bin/python bench/compare.py --jobs 64 --models tiny,small --repeats 3 --plot docs/compare.png
    .venv/bin/python bench/compare.py --dtype bfloat16 ...   # where the CPU multiplies bf16 natively (AMX)
    # vLLM CPU joins when its venv exists: bash bench/peers/setup.sh (default /work/peers-venv)

Systems: (hf1) HF `generate` one job at a time, (hfb) HF padded batched `generate` in batches of 32,
(engine) the vlmq engine alone, (engine_torch) the same without its CPU fast paths (C++ decode attention,
oneDNN-packed linears), (engine_compile) the engine with its decoder layers compiled by torch.compile
(VLMQ_ENGINE_COMPILE; compiling is warm-up, outside the timing), (engine_pillow) the engine with its image
processor resizing by Pillow instead of torch's kernel (VLMQ_IMAGE_RESIZE=pillow), (service) vlmq as a user
meets it: POST /v1/jobs over HTTP -> Postgres -> Redis -> `vlmq worker` -> S3 + SQL, polled until every job
succeeded (bench/service_stack.py: each service its own process, with its own redis-server, Postgres cluster and
the S3 server), (service_batch) the same stack fed through the OpenAI Batch API instead: one JSONL upload, until the
batch completed and its output file was written (bench/service_submit.py), (run) `vlmq run` of the jobs as a
batch file, a fresh process on embedded defaults, timed by the part of its run phase after its model was loaded
(the whole run phase and its wall, imports and model load included, printed beside), (hfb_process) HF padded
batches of 32 in a fresh process with transformers' own classes, timed by its wall, imports and load included
(bench/run_system.py), (vllm) vLLM's offline `LLM.generate` (bench/peers). The service's S3 server is moto's
(`--s3 moto`, the tests' server) or rclone's
(`--s3 rclone`, a Go server as MinIO is; tests/s3_server.py); `--s3 moto,rclone` runs each service system
against both, side by side, labelled `service+moto`, `service+rclone`. `--service-set LABEL:KEY=VALUE,...` adds a
service system run with those settings on top (VLMQ_KEY=VALUE in each process), labelled `service+LABEL`, so a
setting's effect is measured side by side: `--service-set nofreeze:gc_freeze=false`.
Workloads: each model with one image per job, and the same prompts text-only, so the image tax shows: the
extra wall time of the image jobs over the text jobs, against a batched vision forward of the same images
alone. The machine: the GEMM peak in the run's dtype, measured in this run; the FLOPs each workload needs
(vision, prefill, decode; counted from the configs and the token counts), and achieved/peak.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from engine import SPECS, WORDS, cpu_name, hf_one_at_a_time, hf_padded_batches, new_engine  # noqa: E402
from PIL import Image  # noqa: E402

from tests.s3_server import S3_SERVERS, S3Server  # noqa: E402
from worker.engine.allocator import keep_freed_memory  # noqa: E402
from worker.inference.generation import GenerationRequest, SamplingParams  # noqa: E402
from worker.inference.image_resize import use_torch_resize  # noqa: E402
from worker.inference.model_loader import LoadedModel, load_model  # noqa: E402
from worker.inference.tiny_model import build_tiny_llava  # noqa: E402

PEERS_VENV = Path(os.environ.get("VLMQ_PEERS_VENV", "/work/peers-venv"))
# bench/engine.py's models, with head sizes vLLM's CPU attention has kernels for (tiny's 96/4 = 24 it has not).
MODELS = {"tiny": replace(SPECS["tiny"], text_hidden=128), "small": SPECS["small"]}


@dataclass
class Run:
    system: str
    seconds: float
    tokens: dict[str, list[int]] = field(default_factory=dict)  # job id -> generated ids (or text for service)


def make_jobs(n: int, with_image: bool, max_tokens: int, seed: int = 0, prefix: str = "job",
              system: str = "", image_size: tuple[int, int] = (224, 224)) -> list[GenerationRequest]:
    """Same prompts with or without their image (the image tax compares the two); with `system`, every job
    starts with that system prompt, as a dataset's rows often share one instruction. Images are `image_size`
    (width, height) before the model's processor resizes them: a photo's size costs decoding and resizing."""
    rng = random.Random(seed)
    width, height = image_size
    side = max(4, min(width, height) // 9)
    jobs = []
    for i in range(n):
        image = Image.new("RGB", image_size, tuple(rng.randint(0, 255) for _ in range(3)))
        for _ in range(12):  # a few shapes, so images differ beyond their colour
            x, y = rng.randint(0, width - side), rng.randint(0, height - side)
            image.paste(tuple(rng.randint(0, 255) for _ in range(3)), (x, y, x + side, y + side))
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
        content: list[dict[str, Any]] = [{"type": "text", "text": words}]
        if with_image:
            content.insert(0, {"type": "image"})
        messages = [{"role": "user", "content": content}]
        if system:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
        jobs.append(GenerationRequest(f"{prefix}-{i}", messages, [image] if with_image else [],
                                      SamplingParams(max_tokens=max_tokens)))
    return jobs


def warmup_jobs(like: list[GenerationRequest], n: int, seed: int, prefix: str) -> list[GenerationRequest]:
    """`n` short jobs of the same kind as `like` (with or without an image, of the same size), for a warm-up."""
    if not like[0].images:
        return make_jobs(n, False, 4, seed=seed, prefix=prefix)
    return make_jobs(n, True, 4, seed=seed, prefix=prefix, image_size=like[0].images[0].size)


def run_engine(path: Path, jobs: list[GenerationRequest], dtype: torch.dtype, cpu_paths: bool = True,
               compile_layers: bool = False, torch_resize: bool = True) -> tuple[Run, list[int], list[int]]:
    try:
        return _run_engine(path, jobs, dtype, cpu_paths, compile_layers, torch_resize)
    finally:
        use_torch_resize(True)  # process-wide: the next system (HF's, on the model loaded first) resizes as before


def _step_seconds(prefill: float, decode: float) -> str:
    return f"; steps with prompt tokens {prefill:.2f} s, decode-only steps {decode:.2f} s"


def _run_engine(path: Path, jobs: list[GenerationRequest], dtype: torch.dtype, cpu_paths: bool,
                compile_layers: bool, torch_resize: bool) -> tuple[Run, list[int], list[int]]:
    engine = new_engine(path, cpu_paths, dtype, compile_layers, torch_resize)  # model load, KV allocation: start-up
    engine.generate(warmup_jobs(jobs, 4, seed=99, prefix="warm"))
    if compile_layers:  # a batch of one token is a graph of its own (torch specialises sizes 0 and 1)
        engine.generate(warmup_jobs(jobs, 1, seed=98, prefix="warm1"))
    start, cpu_start, steps = time.perf_counter(), time.process_time(), engine.stats.num_steps
    prefill_before, decode_before = engine.stats.prefill_step_seconds, engine.stats.decode_step_seconds
    vision_before = len(engine.runner.vision_batch_sizes)
    results = engine.generate(jobs)
    seconds = time.perf_counter() - start
    name = ("engine_compile" if compile_layers else "engine_pillow" if not torch_resize
            else "engine" if cpu_paths else "engine_torch")
    vision = engine.runner.vision_batch_sizes[vision_before:]
    print(f"  {name} alone: {1000 * (time.process_time() - cpu_start) / len(jobs):.1f} ms of CPU per job, "
          f"{engine.stats.num_steps - steps} steps"
          + (f", {len(vision)} vision batches of {sum(vision) / len(vision):.1f} images" if vision else "")
          + _step_seconds(engine.stats.prefill_step_seconds - prefill_before,
                          engine.stats.decode_step_seconds - decode_before)
          + f"; KV cache in {str(engine.runner.kv_caches[0][0].dtype).removeprefix('torch.')}")
    return (Run(name, seconds, {r.request_id: r.token_ids for r in results}),
            [r.prompt_tokens for r in results], [len(r.token_ids) for r in results])


def run_hf(loaded: LoadedModel, jobs: list[GenerationRequest], batched: bool) -> Run:
    start = time.perf_counter()
    tokens = (hf_padded_batches if batched else hf_one_at_a_time)(loaded, jobs)
    return Run("hfb" if batched else "hf1", time.perf_counter() - start, tokens)


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _batch_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _request_body(job: GenerationRequest) -> dict[str, Any]:
    """The job as a chat completion body, its image as a PNG data URL."""
    image = {"type": "image_url", "image_url": {"url": _data_url(job.images[0])}} if job.images else None
    messages = [{"role": m["role"], "content": [image if p["type"] == "image" else p for p in m["content"]]}
                for m in job.messages]
    return {"messages": messages, "max_tokens": job.sampling.max_tokens}


def run_vlmq_file(path: Path, jobs: list[GenerationRequest], threads: int, work: Path, dtype: str) -> Run:
    """`vlmq run` of the jobs as a batch file, a fresh process (bench/run_system.py): its run phase."""
    from run_system import run_vlmq

    phase, loaded, wall, texts = run_vlmq(path, [_batch_line(job.request_id, _request_body(job)) for job in jobs],
                                          threads, work, dtype)
    print(f"  run: run phase {phase:.2f} s, {loaded:.2f} s of it with the model loaded; wall {wall:.2f} s with "
          "imports, model load and the output file")
    return Run("run", loaded, texts)


def saved_images(jobs: list[GenerationRequest], work: Path, tag: str) -> list[str | None]:
    """Each job's image as a PNG file in `work` (None for a text job), for a system run in a process of its own."""
    paths: list[str | None] = []
    for i, job in enumerate(jobs):
        path = None
        if job.images:
            path = str(work / f"{tag}-{i}.png")
            job.images[0].save(path)
        paths.append(path)
    return paths


def run_hfb_process(path: Path, jobs: list[GenerationRequest], threads: int, work: Path, dtype: str) -> Run:
    """HF padded batches of 32 in a fresh process (bench/hf_batch_process.py): its wall, imports and load in."""
    from run_system import run_hf_process

    work.mkdir(parents=True, exist_ok=True)
    specs = [{"id": job.request_id, "messages": job.messages, "image": image, "max_tokens": job.sampling.max_tokens}
             for job, image in zip(jobs, saved_images(jobs, work, "job"), strict=True)]
    wall, tokens = run_hf_process(path, specs, threads, work, dtype)
    return Run("hfb_process", wall, tokens)


def run_service(path: Path, jobs: list[GenerationRequest], threads: int, work: Path, s3_endpoint: str,
                s3_pid: int, dtype: str = "float32", batch: bool = False, profile: Path | None = None,
                profile_cpu: bool = False, label: str | None = None, settings: dict[str, str] | None = None) -> Run:
    """Timed from the first byte sent to done (bench/service_submit.py: each job POSTed, or with `batch` one
    Batch API file, until every job succeeded, or the batch completed). Prints the CPU each part of the stack
    spent per job in that time. With `profile`, py-spy samples the API and the worker meanwhile, in whichever
    thread holds the GIL (collapsed stacks, `<profile>.<part>.txt`); with `profile_cpu`, every thread that is
    on a CPU instead, the worker's engine process included."""
    from service_stack import ServiceStack
    from service_submit import BatchSubmission, JobSubmission
    from sqlalchemy import create_engine, text

    stack = ServiceStack(work, s3_endpoint, path, device="cpu", dtype=dtype, kv_num_blocks=8192,
                         max_num_seqs=256, max_num_batched_tokens=4096, sweep_interval_seconds=5, **(settings or {}))
    try:
        stack.start(worker_concurrency=256, worker_threads=threads)
        bodies = [_request_body(job) for job in jobs]
        custom_ids = [job.request_id for job in jobs]
        kind = BatchSubmission if batch else JobSubmission
        submission = kind(stack, bodies, custom_ids)
        name = label or submission.system
        sql = create_engine(stack.postgres.url)
        # Warmed up as the engine alone is (a few short jobs of the same kind first): a deployment pays its first
        # batch's cold start once, and serves every later one warm.
        warm = warmup_jobs(jobs, 4, seed=99, prefix="warm")
        warm_up = kind(stack, [_request_body(job) for job in warm], [job.request_id for job in warm])
        with sql.connect() as conn:
            warm_up.submit()
            while not warm_up.done(conn):
                conn.commit()
                time.sleep(0.02)
        warm_up.close()
        commits = text("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()")
        with sql.connect() as conn:
            conn.execute(commits)
            time.sleep(1.5)  # let start-up's statistics reach pg_stat_database before the first reading
            transactions_before = conn.execute(commits).scalar_one()
            conn.commit()
            spy = str(Path(sys.executable).parent / "py-spy")
            mode = ["--subprocesses"] if profile_cpu else ["--gil"]
            spies = [subprocess.Popen([spy, "record", "--format", "raw", *mode, "--nonblocking", "-r", "250",
                                       "-o", f"{profile}.{part}.txt", "-p", str(stack.processes[part].pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for part in (("api", "worker") if profile else ())]
            time.sleep(1.0 if spies else 0)
            metrics_before = stack.worker_metrics()
            cpu_before, client_before = stack.cpu_seconds(s3_pid), os.times()
            start, sent_at = time.perf_counter(), time.time()
            submission.submit()
            while not submission.done(conn):
                conn.commit()
                time.sleep(0.02)
            seconds = time.perf_counter() - start
            cpu_after, client_after = stack.cpu_seconds(s3_pid), os.times()
            # Seconds after the first byte was sent (the database's clock is this machine's).
            spans = conn.execute(text(
                "SELECT extract(epoch FROM min(created_at)) - :t, extract(epoch FROM max(created_at)) - :t,"
                " extract(epoch FROM min(started_at)) - :t, extract(epoch FROM max(started_at)) - :t,"
                " extract(epoch FROM min(finished_at)) - :t, extract(epoch FROM max(finished_at)) - :t,"
                " (SELECT extract(epoch FROM max(completed_at)) - :t FROM batches),"
                " (SELECT extract(epoch FROM max(created_at)) - :t FROM files),"
                " (SELECT extract(epoch FROM max(created_at)) - :t FROM batches),"
                " (SELECT extract(epoch FROM max(in_progress_at)) - :t FROM batches),"
                " (SELECT extract(epoch FROM max(finalizing_at)) - :t FROM batches)"
                " FROM jobs WHERE created_at >= to_timestamp(:t)"), {"t": sent_at}).one()
            for proc in spies:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
            conn.commit()
            time.sleep(1.5)  # backends flush their statistics to pg_stat_database at most once a second
            transactions = conn.execute(commits).scalar_one() - transactions_before
            metrics = stack.worker_metrics()  # the engine's counters reached the worker by now (idle snapshot)
        sql.dispose()
        gc_counters = [f"vlmq_gc_{kind}_total{{generation={g}}}"
                       for g in range(3) for kind in ("pauses", "pause_seconds")]
        delta = {name: metrics.get(name, 0.0) - metrics_before.get(name, 0.0)
                 for name in ("vlmq_engine_steps_total", "vlmq_engine_vision_batch_size_count",
                              "vlmq_engine_vision_batch_size_sum", "vlmq_engine_prefill_step_seconds_total",
                              "vlmq_engine_decode_step_seconds_total", *gc_counters)}
        vision = delta["vlmq_engine_vision_batch_size_count"]
        print(f"  {name} engine: {delta['vlmq_engine_steps_total']:.0f} steps"
              + (f", {vision:.0f} vision batches of {delta['vlmq_engine_vision_batch_size_sum'] / vision:.1f} images"
                 if vision else "")
              + _step_seconds(delta["vlmq_engine_prefill_step_seconds_total"],
                              delta["vlmq_engine_decode_step_seconds_total"]))
        stages = {m["stage"]: value - metrics_before.get(name, 0.0) for name, value in metrics.items()
                  if (m := re.fullmatch(r"vlmq_worker_stage_cpu_seconds_total\{stage=(?P<stage>\w+)\}", name))}
        if stages:
            print(f"  {name} worker's job threads, CPU per job by stage (ms): "
                  + ", ".join(f"{stage} {1000 * s / len(jobs):.2f}" for stage, s in stages.items()))
        print(f"  {name} worker's garbage collections: "
              + ", ".join(f"generation {g} {delta[f'vlmq_gc_pauses_total{{generation={g}}}']:.0f} "
                          f"({1000 * delta[f'vlmq_gc_pause_seconds_total{{generation={g}}}']:.1f} ms)"
                          for g in range(3))
              + f"; {metrics.get('vlmq_gc_frozen_objects', 0.0):.0f} objects frozen")
        spent = {name: cpu_after[name] - cpu_before[name] for name in cpu_before}
        spent["client"] = (client_after.user + client_after.system) - (client_before.user + client_before.system)
        print(f"  {name} CPU per job (ms): " + ", ".join(f"{name} {1000 * s / len(jobs):.1f}"
                                                          for name, s in spent.items())
              + f"; total {sum(spent.values()):.2f}s of CPU in {seconds:.2f}s wall; "
              + f"{transactions / len(jobs):.1f} Postgres transactions per job")
        print(f"  {name} timeline (s after the first byte sent): "
              + "jobs written {:.2f}-{:.2f}, claimed {:.2f}-{:.2f}, finished {:.2f}-{:.2f}".format(
                  *(float(x) for x in spans[:6]))
              + ("" if spans[6] is None else
                 ", file stored {:.2f}, batch created {:.2f}, in progress {:.2f}, finalizing {:.2f}, completed {:.2f}"
                 .format(*(float(x) for x in (spans[7], spans[8], spans[9], spans[10], spans[6]))))
              + f", seen done {seconds:.2f}")
        texts = submission.texts()
        submission.close()
        for part in stack.processes:  # a fast run that logged trouble on the way is not a clean run
            problems = Counter(re.sub(r"\d+", "N", line)[:160] for line in stack.log(part).splitlines()
                               if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line))
            for line, n in problems.most_common(5):
                print(f"  {part} logged {n}x: {line}")
        return Run(name, seconds, texts)
    except Exception:
        for name in stack.processes:
            print(f"--- {name} log tail ---\n{stack.log(name)[-2000:]}")
        raise
    finally:
        stack.close()


def run_vllm(path: Path, loaded: LoadedModel, jobs: list[GenerationRequest], threads: int, work: Path,
             dtype: str = "float32") -> Run | None:
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        print(f"  (vllm skipped: no peers venv at {PEERS_VENV}; bash bench/peers/setup.sh)")
        return None
    sys.path.insert(0, str(ROOT / "bench" / "peers"))
    from convert import convert

    model_dir = convert(path, work / f"{path.name}-vllm")

    def spec(batch: list[GenerationRequest], tag: str) -> list[dict[str, Any]]:
        out = []
        for job, image in zip(batch, saved_images(batch, work, tag), strict=True):
            prompt = loaded.processor.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
            out.append({"id": job.request_id, "prompt": prompt, "image": image, "max_tokens": job.sampling.max_tokens})
        return out

    warm = warmup_jobs(jobs, 4, seed=99, prefix="warm")
    jobs_file = work / "vllm-jobs.json"
    jobs_file.write_text(json.dumps({"warmup": spec(warm, "warm"), "jobs": spec(jobs, "job")}))
    proc = subprocess.run([str(python), str(ROOT / "bench" / "peers" / "vllm_run.py"), str(model_dir),
                           str(jobs_file), "--threads", str(threads), "--dtype", dtype], capture_output=True,
                          text=True, timeout=3600, env={**os.environ, "PYTHONPATH": ""})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
    if line is None:
        print(f"  (vllm failed, exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return None
    result = json.loads(line.removeprefix("VLLM_RESULT "))
    return Run("vllm", result["seconds"], result["tokens"])


def vision_only_seconds(loaded: LoadedModel, images: list[Image.Image], batch: int = 64) -> float:
    """The images of the workload through the vision tower and projector alone, in batches."""
    pixels = loaded.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    pixels = pixels.to(loaded.model.dtype)
    with torch.inference_mode():
        loaded.model.get_image_features(pixel_values=pixels[:4])  # warm-up
        start = time.perf_counter()
        for i in range(0, len(images), batch):
            loaded.model.get_image_features(pixel_values=pixels[i:i + batch])
    return time.perf_counter() - start


def gemm_peak_gflops(n: int = 2048, repeats: int = 7, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """GEMM GFLOP/s of n x n x n in `dtype`, median of `repeats`, by each library torch reaches on CPU: its BLAS
    (`torch.mm`; MKL on x86, which on AMD CPUs may not take its AVX-512 path) and oneDNN with a pre-packed
    weight (what the engine's linears run). The machine's peak is the faster of the two: measured against
    the slower one, a workload could show more than 100%. A library whose n x n call would take seconds (a
    dtype without native instructions on this CPU) is measured at 512 instead, named `name@512`."""
    rates = {}
    for name, call in _gemm_calls(256, dtype).items():
        call()  # oneDNN builds its kernel on the first call
        start = time.perf_counter()
        call()
        size = n if (time.perf_counter() - start) * (n / 256) ** 3 < 2.0 else 512
        call = _gemm_calls(size, dtype)[name]
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rates[name if size == n else f"{name}@{size}"] = 2 * size**3 / statistics.median(times) / 1e9
    return rates


def _gemm_calls(n: int, dtype: torch.dtype) -> dict[str, Any]:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    calls = {"blas": lambda: torch.mm(a, b)}
    if torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), n)
            calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        except RuntimeError:  # oneDNN packs bf16 only where the CPU has the instructions for it
            pass
    return calls


def workload_flops(loaded: LoadedModel, prompt_tokens: list[int], generated: list[int], n_images: int) -> float:
    """Matmul FLOPs of vision (per image, counted by torch's FlopCounterMode) plus the LM's prefill and
    decode: 2 x weights per token and 4 x layers x heads x head_dim x context for attention."""
    from torch.utils.flop_counter import FlopCounterMode

    vision = 0.0
    if n_images:
        pixels = loaded.processor.image_processor(images=[Image.new("RGB", (224, 224))], return_tensors="pt")
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            loaded.model.get_image_features(pixel_values=pixels["pixel_values"])
        vision = counter.get_total_flops() * n_images
    cfg = loaded.model.config.text_config
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or h // heads
    linear = 2 * layers * (h * heads * dh + 2 * h * kv * dh + heads * dh * h + 3 * h * inter)
    attn_per_ctx = 4 * layers * heads * dh
    lm_head = 2 * h * cfg.vocab_size
    total = vision
    for p, g in zip(prompt_tokens, generated, strict=True):
        total += (p + g) * linear + attn_per_ctx * ((p + g) * (p + g + 1) / 2) + g * lm_head
    return total


def agreement(run: Run, reference: Run, loaded: LoadedModel) -> str:
    if run is reference:
        return "ref"
    same = 0
    for job_id, ref in reference.tokens.items():
        got = run.tokens.get(job_id)
        if isinstance(got, str):
            same += got == loaded.tokenizer.decode(ref, skip_special_tokens=True)
        else:
            same += got == ref
    return f"{same}/{len(reference.tokens)}"


def image_size_arg(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if match is None or min(int(match[1]), int(match[2])) < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHT, each at least 16, e.g. 1600x1200")
    return int(match[1]), int(match[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each system, alternating; medians shown")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--systems", default="hf1,hfb,engine_torch,engine,service,vllm")
    parser.add_argument("--system-prompt", default="", help="a system prompt every job starts with")
    parser.add_argument("--image-size", default="224x224", type=image_size_arg, metavar="WIDTHxHEIGHT",
                        help="the jobs' images before the processor resizes them (photos are megapixels)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="every system's weights, activations and KV cache, and the GEMM peak's operands")
    parser.add_argument("--service-threads", type=int, default=None,
                        help="the service worker's engine threads (default: --threads)")
    parser.add_argument("--s3", default="moto",
                        help="the service's S3 server(s), comma-separated: moto, rclone (tests/s3_server.py)")
    parser.add_argument("--service-set", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                        help="also run each service system with these settings, labelled service+LABEL")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the service's API and worker: prefix")
    parser.add_argument("--profile-cpu", action="store_true",
                        help="with --profile: sample every thread on a CPU (engine process included), not the GIL")
    args = parser.parse_args()
    from worker.engine import cpu_kernels

    cpu_kernels.kernels(wait=True)  # built before any timing: a process that finds them unbuilt runs the torch path
    torch.set_num_threads(args.threads)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    keep_freed_memory()
    systems = args.systems.split(",")
    s3_kinds = args.s3.split(",")
    if unknown := set(s3_kinds) - set(S3_SERVERS):
        parser.error(f"--s3: unknown server(s) {', '.join(sorted(unknown))}; one of {', '.join(S3_SERVERS)}")
    variants: dict[str, dict[str, str]] = {"": {}}
    for spec in args.service_set:
        label, _, pairs = spec.partition(":")
        try:
            variants[label] = dict(pair.split("=", 1) for pair in pairs.split(","))
        except ValueError:
            parser.error(f"--service-set {spec!r}: expected LABEL:KEY=VALUE[,KEY=VALUE...]")
        if not label or not re.fullmatch(r"[a-z0-9_]+", label):
            parser.error(f"--service-set {spec!r}: the label must be lower-case letters, digits and _")
    dtype = getattr(torch, args.dtype)
    rates = gemm_peak_gflops(dtype=dtype)
    peak = max(rates.values())
    size = max(rates, key=rates.__getitem__).partition("@")[2] or "2048"
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads, {args.dtype}; GEMM {size}^2 peak "
          f"measured now: {peak:.0f} GFLOP/s ({', '.join(f'{name} {rate:.0f}' for name, rate in rates.items())})")
    table: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        s3_servers: dict[str, S3Server] = {}
        try:
            if {"service", "service_batch"} & set(systems):
                for kind in s3_kinds:
                    s3_servers[kind] = S3Server(kind)
            for name in args.models.split(","):
                path = build_tiny_llava(work / name, seed=0, spec=MODELS[name])
                loaded = load_model(str(path), dtype=dtype)
                seconds_by: dict[tuple[str, str], float] = {}
                flops_by: dict[str, float] = {}
                for kind in ("image", "text"):
                    jobs = make_jobs(args.jobs, kind == "image", args.max_tokens, system=args.system_prompt,
                                     image_size=args.image_size)
                    if kind == "image":  # for the vision tower alone, after the runs
                        images = [j.images[0] for j in jobs]
                    first_engine, prompt_tokens, generated = run_engine(path, jobs, dtype)
                    flops = workload_flops(loaded, prompt_tokens, generated, args.jobs if kind == "image" else 0)
                    flops_by[kind] = flops
                    repeats: dict[str, list[Run]] = {}
                    for rep in range(args.repeats):  # systems alternate, so drifts of the machine hit all alike
                        for system in systems:
                            run: Run | None = None
                            if system == "engine":
                                run = first_engine if rep == 0 else run_engine(path, jobs, dtype)[0]
                            elif system == "engine_torch":
                                run = run_engine(path, jobs, dtype, cpu_paths=False)[0]
                            elif system == "engine_compile":
                                run = run_engine(path, jobs, dtype, compile_layers=True)[0]
                            elif system == "engine_pillow":
                                run = run_engine(path, jobs, dtype, torch_resize=False)[0]
                            elif system in ("hf1", "hfb"):
                                run = run_hf(loaded, jobs, system == "hfb")
                            elif system in ("service", "service_batch"):
                                for (s3_kind, s3), (variant, settings) in itertools.product(
                                        s3_servers.items(), variants.items()):
                                    label = system if s3_kinds == ["moto"] else f"{system}+{s3_kind}"
                                    label += f"+{variant}" if variant else ""
                                    tag = f"{name}-{kind}-{s3_kind}" + (f"-{variant}" if variant else "")
                                    run = run_service(path, jobs, args.service_threads or args.threads,
                                                      work / f"svc-{tag}-{rep}", s3.endpoint,
                                                      s3.pid, dtype=args.dtype, batch=system == "service_batch",
                                                      profile=args.profile and Path(f"{args.profile}-{tag}"),
                                                      profile_cpu=args.profile_cpu, label=label, settings=settings)
                                    repeats.setdefault(label, []).append(run)
                                run = None
                            elif system == "run":
                                run = run_vlmq_file(path, jobs, args.threads, work / f"run-{name}-{kind}-{rep}",
                                                    args.dtype)
                            elif system == "hfb_process":
                                run = run_hfb_process(path, jobs, args.threads, work / f"hfb-{name}-{kind}-{rep}",
                                                      args.dtype)
                            elif system == "vllm":
                                run = run_vllm(path, loaded, jobs, args.threads, work / f"vllm-{name}-{kind}-{rep}",
                                               args.dtype)
                            if run is not None:
                                repeats.setdefault(system, []).append(run)
                    # Each system's median run stands for it; every repeat's time is printed beside it.
                    runs = [sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for rs in repeats.values()]
                    engine_run = next((r for r in runs if r.system == "engine"), first_engine)
                    reference = next((r for r in runs if r.system == "hf1"), engine_run)
                    n_tokens = sum(generated)
                    photo = f" of {args.image_size[0]}x{args.image_size[1]} px" if kind == "image" else ""
                    print(f"\n## {name}, {kind} jobs: {args.jobs} jobs{photo}, max_tokens {args.max_tokens}, "
                          f"{n_tokens} tokens generated, {flops / 1e9:.1f} GFLOP of work")
                    print(f"{'system':<24}{'seconds':>9}{'jobs/s':>9}{'tok/s':>9}{'vs engine':>11}{'of peak':>9}"
                          f"{'same as ' + reference.system:>16}   seconds of each repeat")
                    for run in runs:
                        seconds_by[(run.system, kind)] = run.seconds
                        row = {"model": name, "kind": kind, "system": run.system, "seconds": run.seconds,
                               "jobs_per_s": args.jobs / run.seconds, "tokens_per_s": n_tokens / run.seconds,
                               "of_peak": flops / run.seconds / (peak * 1e9),
                               "agreement": agreement(run, reference, loaded)}
                        table.append(row)
                        row["repeats"] = [r.seconds for r in repeats[run.system]]
                        print(f"{run.system:<24}{run.seconds:>9.2f}{row['jobs_per_s']:>9.1f}{row['tokens_per_s']:>9.0f}"
                              f"{engine_run.seconds / run.seconds:>10.2f}x{100 * row['of_peak']:>8.1f}%"
                              f"{row['agreement']:>16}   {' '.join(f'{x:.2f}' for x in row['repeats'])}")
                vision = vision_only_seconds(loaded, images)
                print(f"\nimage tax ({name}): batched vision alone {vision:.2f}s for {args.jobs} images")
                # The image tokens also pass through the LM (prefill, then every decode step attends to them):
                # work that no scheduling of the vision tower removes. Its floor is that work at the GEMM peak.
                extra_flops = flops_by["image"] - flops_by["text"]
                vision_flops = workload_flops(loaded, [], [], args.jobs)
                lm_extra = extra_flops - vision_flops
                lm_seconds = lm_extra / (peak * 1e9)
                floor = vision + lm_seconds
                print(f"  image jobs need {extra_flops / 1e9:.3f} GFLOP more than text jobs: vision "
                      f"{vision_flops / 1e9:.3f}, their image tokens through the LM {lm_extra / 1e9:.3f} "
                      f"({lm_seconds:.3f}s at the peak); floor of the tax {floor:.3f}s")
                for system in dict.fromkeys(system for system, _ in seconds_by):
                    if (system, "image") in seconds_by and (system, "text") in seconds_by:
                        extra = seconds_by[(system, "image")] - seconds_by[(system, "text")]
                        print(f"  {system:<8} image jobs took {extra:+.2f}s over text jobs = "
                              f"{extra / vision:.2f}x the vision time, {extra / floor:.2f}x the floor")
        finally:
            for s3 in s3_servers.values():
                s3.close()
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "peak_gflops": peak, "gemm_gflops": rates,
                                         "rows": table}, indent=2))
    if args.plot:
        plot(table, args.plot, args.dtype, args.threads)


def plot(table: list[dict[str, Any]], out: Path, dtype: str, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["kind"]) for r in table})
    systems = list(dict.fromkeys(r["system"] for r in table))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        values = [next((r["jobs_per_s"] for r in table if (r["model"], r["kind"]) == g and r["system"] == system), 0)
                  for g in groups]
        ax.bar([i + k * width for i in range(len(groups))], values, width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{m}\n{k}" for m, k in groups])
    ax.set_ylabel("jobs/s (higher is better)")
    ax.set_yscale("log")
    ax.set_title(f"Throughput per system and workload (same jobs, greedy, {dtype}, {threads} CPU threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
