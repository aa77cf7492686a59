"""compose/: the files are valid against the compose specification's JSON schema, and every command, variable,
port and path they use exists in Blink. (No Docker engine here: nothing is started.)"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

from blink.services.cli import main as blink_main
from blink.shared.settings import Settings
from tests.support.environment import EXTRA_VARIABLES

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
FILES = sorted(COMPOSE.glob("docker-compose*.yml"))


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (!reset, !override), which plain YAML does not know."""


for tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(tag, lambda loader, node: loader.construct_sequence(node)
                                  if isinstance(node, yaml.SequenceNode) else loader.construct_object(node))


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def validator():
    text = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    schema = json.loads(text)
    return jsonschema.validators.validator_for(schema)(schema)


def test_the_files():
    assert [f.name for f in FILES] == ["docker-compose.cpu.yml", "docker-compose.cpuset.yml",
                                       "docker-compose.rdma-ingress.yml", "docker-compose.rdma.yml",
                                       "docker-compose.tcp-ingress.yml", "docker-compose.tcp.yml",
                                       "docker-compose.yml"]


def test_the_rdma_hosts():
    """RDMA on top of the two-host files: the engine host registers the table with the NIC, the ingress host writes
    into it, with the RDMA devices and locked memory both sides need (the tcp files alone need neither)."""
    engine = load(COMPOSE / "docker-compose.rdma.yml")["services"]["engine"]
    ingress = load(COMPOSE / "docker-compose.rdma-ingress.yml")["services"]["ingress"]
    for service in (engine, ingress):
        assert service["environment"]["BLINK_TRANSPORT"] == "rdma"
        assert service["devices"] == ["/dev/infiniband:/dev/infiniband"] and "IPC_LOCK" in service["cap_add"]
        assert service["ulimits"]["memlock"] == -1
    for name in ("docker-compose.tcp.yml", "docker-compose.tcp-ingress.yml"):
        for service in load(COMPOSE / name)["services"].values():
            assert "devices" not in service and "cap_add" not in service, name


def test_the_two_hosts_share_one_control_key():
    """The engine host's control and relay ports listen beyond the container (asked for, by BLINK_BIND_HOST) and take
    only the holders of the deployment's key: every service on both hosts mounts the same secret and points its key
    file at it; the ingress host reaches the engine's ports over the zmq transport."""
    engine_host = load(COMPOSE / "docker-compose.tcp.yml")
    ingress_host = load(COMPOSE / "docker-compose.tcp-ingress.yml")
    engine = engine_host["services"]["engine"]
    assert engine["environment"]["BLINK_BIND_HOST"] == "0.0.0.0"
    assert any("BLINK_CONTROL_PORT" in port for port in engine["ports"])
    assert any("BLINK_RELAY_PORT" in port for port in engine["ports"])
    ingress = ingress_host["services"]["ingress"]
    assert ingress["environment"]["BLINK_TRANSPORT"] == "zmq" and "BLINK_ENGINE_HOST" in ingress["environment"]
    assert engine_host["services"]["ingress"] == {"profiles": ["ingress-elsewhere"]}  # one ingress per slot table
    services = [engine, engine_host["services"]["watchdog"], ingress]
    for service in services:
        assert service["secrets"] == ["blink_control_key"]
        assert service["environment"]["BLINK_CONTROL_KEY_FILE"] == "/run/secrets/blink_control_key"
    for stack in (engine_host, ingress_host):
        assert "BLINK_CONTROL_KEY_SOURCE" in stack["secrets"]["blink_control_key"]["file"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_valid_against_the_compose_schema(path, validator):
    errors = sorted(validator.iter_errors(load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_stack():
    stack = load(COMPOSE / "docker-compose.yml")
    services = stack["services"]
    assert set(services) == {"namespaces", "engine", "ingress", "watchdog"}
    engine = services["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert services["namespaces"]["ipc"] == "shareable" and services["namespaces"]["init"] is True
    for name in ("engine", "ingress", "watchdog"):  # none of them pid 1: each can be killed and restarted
        assert services[name]["ipc"] == "service:namespaces" and services[name]["pid"] == "service:namespaces"
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        # The engine's build makes the image the others run: `up` must not try a registry for it first.
        assert service.get("pull_policy") == (None if name == "engine" else "never"), name
    ingress = services["ingress"]
    assert ingress["ports"] == ["${BLINK_PORT:-8000}:8000", "${BLINK_ZMQ_PORT:-5557}:5557"]
    assert ingress["environment"]["BLINK_PORT"] == "8000" and ingress["environment"]["BLINK_ZMQ_PORT"] == "5557"
    assert "/health" in " ".join(ingress["healthcheck"]["test"])
    for service in (engine, ingress):
        assert int(service["healthcheck"]["start_period"].removesuffix("s")) >= 300
    cpu = load(COMPOSE / "docker-compose.cpu.yml")["services"]["engine"]
    assert cpu["deploy"]["resources"]["reservations"]["devices"] == [] and cpu["environment"]["BLINK_DEVICE"] == "cpu"
    pinned = load(COMPOSE / "docker-compose.cpuset.yml")["services"]["engine"]
    assert "cpuset" in pinned and "cpus" in pinned


def test_every_command_and_variable_exists(capsys):
    settings = {f"BLINK_{name.upper()}" for name in Settings.model_fields} | EXTRA_VARIABLES
    for path in FILES:
        text = path.read_text()
        assert "~" not in text, f"{path.name}: use ${{HOME}}, not ~"
        for name, service in load(path)["services"].items():
            for variable in service.get("environment") or {}:
                assert variable in settings, f"{path.name}: {name} sets {variable}, which Blink does not read"
            command = service.get("command")
            if command and command[0] != "sleep":  # the namespaces' holder
                assert command[0] == "blink"
                with pytest.raises(SystemExit) as exit_:  # each subcommand's --help exits 0
                    blink_main([*command[1:], "--help"])
                assert exit_.value.code == 0, f"{path.name}: {command}"
            check = (service.get("healthcheck") or {}).get("test", [])
            if check[1:3] == ["blink", "probe"]:
                with pytest.raises(SystemExit) as exit_:
                    blink_main([*check[2:], "--help"])
                assert exit_.value.code == 0
    capsys.readouterr()


@pytest.mark.parametrize("dockerfile", sorted(COMPOSE.glob("Dockerfile.*")), ids=lambda p: p.name)
def test_dockerfiles(dockerfile):
    """What they copy exists and is let through .dockerignore; the base and the package sources can be changed with
    build arguments whose defaults are a stock Docker host's; the compiler and the wheels stay where they should."""
    root = COMPOSE.parent
    text = dockerfile.read_text()
    allowed = [line[1:] for line in (root / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    for source in re.findall(r"^COPY (\S+)", text, flags=re.MULTILINE):
        if source.startswith("--from="):
            continue
        assert (root / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repository"
        assert source in allowed or source in ("./",), f"{dockerfile.name} copies {source}, which .dockerignore hides"
    cmd = json.loads(re.search(r"^CMD (.+)$", text, flags=re.MULTILINE).group(1))
    assert cmd == ["blink", "serve"]
    assert '".[engine,ingress]"' in text
    args = dict(re.findall(r"^ARG (\w+)(?:=(.*))?$", text, flags=re.MULTILINE))
    assert args["BASE"] == "python:3.11-slim-bookworm" and text.count("FROM ${BASE}") == 1
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "CA_CERTS", "TORCH_INDEX_URL"} <= set(args)
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    assert "g++" in stages[0], "the CPU kernels are built where they run (-march=native): the image needs g++"
    assert "COPY compose/wheels /wheels" in stages[1] and "/wheels" not in stages[-1], "the wheels stay in the build"


def test_the_wheels_directory_is_kept_but_its_wheels_are_not():
    ignore = (COMPOSE / "wheels" / ".gitignore").read_text().split()
    assert "*" in ignore and "!.gitignore" in ignore
