# Sourced at the start of a device call (docs/gpu.md): installs the carried wheels (scripts/gpu_wheels.sh) and Blink
# itself, as a wheel would install it, into /tmp/site, which the GPU image's python3 then imports from.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . &&
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
