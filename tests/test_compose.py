"""compose.yaml, the Dockerfile and .env.example checked against the code, since Docker cannot run here: every
command and healthcheck is a real `vlmq` invocation, every variable a real setting, every long-running service
has a healthcheck, the images' commands exist and the API image leaves out the model stack. When a
`docker compose` (or Debian's docker-compose) is installed, its `config` must accept the file too.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer

from cli.main import app
from common.infra.settings import Settings
from tests.stack import COMPOSE, LONG_RUNNING, ROOT, load_compose

_spec = importlib.util.spec_from_file_location("docker_requirements", ROOT / "docker" / "requirements.py")
assert _spec is not None and _spec.loader is not None
docker_requirements = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docker_requirements)
MODEL_STACK, requirement_name, requirements = (docker_requirements.MODEL_STACK, docker_requirements.requirement_name,
                                               docker_requirements.requirements)

OURS = ("migrate", "api", "worker", "ingest", "beat")
NOT_SETTINGS = {"HF_TOKEN"}  # read by huggingface_hub itself in the worker
SETTINGS = {f"VLMQ_{name.upper()}" for name in Settings.model_fields}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def parse_vlmq(argv: list[str]) -> None:
    """Fails unless `argv` is a `vlmq` command line the CLI accepts (parsed, not run)."""
    assert argv[0] == "vlmq", argv
    command = typer.main.get_command(app).commands.get(argv[1])  # type: ignore[attr-defined]
    assert command is not None, f"`vlmq {argv[1]}` is not a vlmq command"
    command.make_context(argv[1], [re.sub(r"\$\{[^}]*\}", "1", a) for a in argv[2:]])


def test_every_service_command_and_healthcheck_is_a_real_vlmq_command(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(OURS) <= set(services)
    for name in OURS:
        parse_vlmq(services[name]["command"])
    for name in LONG_RUNNING:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        parse_vlmq(test[1:])


def test_every_environment_variable_is_a_setting(compose: dict[str, Any]) -> None:
    for name in OURS:
        env = compose["services"][name].get("environment") or {}
        assert env, name
        unknown = {k for k in env if k not in SETTINGS and k not in NOT_SETTINGS}
        assert not unknown, (name, unknown)
        Settings(**{k.removeprefix("VLMQ_").lower(): v for k, v in env.items() if k.startswith("VLMQ_")
                    and "$" not in str(v)})  # and the values given literally are valid


def test_dotenv_example_lists_every_setting_and_nothing_else() -> None:
    text = (ROOT / ".env.example").read_text()
    listed = set(re.findall(r"^#?\s*(VLMQ_[A-Z0-9_]+)=", text, flags=re.MULTILINE))
    assert listed == SETTINGS, (SETTINGS - listed, listed - SETTINGS)
    compose_vars = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE.read_text()))
    example_vars = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", text, flags=re.MULTILINE))
    assert compose_vars <= example_vars, compose_vars - example_vars


def test_long_running_services_have_healthchecks_and_start_in_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        one_shot = service.get("restart") == "no"
        assert one_shot or "healthcheck" in service, f"{name} runs on but has no healthcheck"
        for dependency, condition in (service.get("depends_on") or {}).items():
            target = services[dependency]
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in target, (name, dependency)
            else:
                assert condition["condition"] == "service_completed_successfully", (name, dependency)
                assert target.get("restart") == "no", (name, dependency)
    for name in ("api", "worker", "ingest", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["flower"]["profiles"] == ["flower"]


def test_only_the_api_is_published_beyond_services_bind(compose: dict[str, Any]) -> None:
    """Postgres, Redis, MinIO and Flower (no login) listen on SERVICES_BIND, loopback unless set; the API,
    which checks keys, on every interface."""
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            if name == "api":
                continue
            assert port.startswith("${SERVICES_BIND:-127.0.0.1}:"), (name, port)


def test_redis_minio_gpu_and_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    redis = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis and "--appendfsync everysec" in redis
    assert "--maxmemory-policy noeviction" in redis
    assert "mc mb --ignore-existing" in " ".join(services["minio-init"]["command"])
    assert services["worker"]["environment"]["VLMQ_S3_CREATE_BUCKET"] == "false"
    device = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "${VLMQ_MODEL" in services["worker"]["environment"]["VLMQ_MODEL"]
    assert any("${HF_CACHE" in v for v in services["worker"]["volumes"])
    sources = {re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v).split(":")[0]
               for s in services.values() for v in s.get("volumes", [])}
    named = {v for v in sources if not v.startswith(("/", "."))}
    assert named <= set(compose["volumes"]), named - set(compose["volumes"])
    for name, service in services.items():
        image = service.get("image", "")
        assert image.startswith("${") or re.search(r":[\w.-]*\d", image), f"{name}: unpinned image {image}"


def dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = ""
    for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line.strip(), flags=re.IGNORECASE)
        if match:
            current = match.group(2) or match.group(1)
            stages[current] = [line.strip()]
        elif current and line.strip() and not line.startswith("#"):
            stages[current].append(line.strip())
    return stages


def test_dockerfile_images_run_vlmq_as_a_user_from_pinned_bases(compose: dict[str, Any]) -> None:
    import json

    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", text)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base.group(1)), "pin the base to a release"
    stages = dockerfile_stages()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for target in ("api", "worker"):
        lines = stages[target]
        assert lines[0].split()[1] == "runtime"
        assert any(re.fullmatch(r"USER vlmq", x) for x in lines), f"{target} must not run as root"
        cmd = json.loads(next(x for x in lines if x.startswith("CMD"))[3:])
        assert cmd[0] in scripts  # the console script the image's pip install creates
        parse_vlmq(cmd)
        assert compose["services"][target]["build"]["target"] == target
    assert any("useradd" in x for x in stages["runtime"])
    assert "requirements.py api" in " ".join(stages["build-api"])
    assert "torch" not in " ".join(stages["build-api"])


def test_the_api_image_leaves_out_only_the_model_stack() -> None:
    every = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    api = requirements("api")
    assert {requirement_name(r) for r in every} - {requirement_name(r) for r in api} == MODEL_STACK
    assert requirements("worker") == every
    blocked = (ROOT / "tests" / "no_torch" / "sitecustomize.py").read_text()
    assert all(f'"{name}"' in blocked for name in MODEL_STACK)  # the smoke test runs the API image's processes so


def _compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose here (tests/setup.sh installs Debian's docker-compose)")
    shutil.copy(COMPOSE, tmp_path / "compose.yaml")
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    result = subprocess.run([*cli, "--profile", "flower", "config", "--services"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == set(load_compose()["services"])
    (tmp_path / ".env").write_text("VLMQ_MODEL=x\n")  # the passwords are required
    result = subprocess.run([*cli, "config"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "POSTGRES_PASSWORD" in result.stderr + result.stdout
