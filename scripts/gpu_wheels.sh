#!/usr/bin/env bash
# Downloads into .whl/ the cp312 wheels Blink needs that the lent GPU machine's image lacks (it has torch, triton,
# numpy, tokenizers, safetensors, transformers, jinja2, httpx, prometheus-client, cuda-bindings, pytest, hypothesis,
# uvloop; docs/gpu.md). The device tool carries .whl with the call; nothing there can reach a package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && { grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude; }
python=${PYTHON:-python3}
platforms=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do  # 2_31: llguidance's
    platforms+=(--platform "$p")
done
# One version of each (two stop the install there); the pins are what CI's venv resolves today.
wheels=(
    pydantic==2.13.4 pydantic-core==2.46.4 pydantic-settings==2.14.1 python-dotenv==1.2.2
    annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0
    structlog==26.1.0 pyzmq==27.3.0 opentelemetry-api==1.45.2  # fastapi imports it
    fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 httptools==0.9.0
    openai==3.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
    gguf==0.19.0  # blink.shared.checkpoints imports it
    llguidance==1.9.1 outlines-core==0.2.14  # structured outputs: the host mode's masks, the device modes' walk
    nvidia-ml-py==13.615.71  # the interference phase's energy per token (NVML)
)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wheels[@]}"
ls .whl
