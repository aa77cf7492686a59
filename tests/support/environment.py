"""The environment variables Blink reads besides its settings' BLINK_* ones, for the deployment files' tests
(tests/unit/test_compose.py, tests/unit/test_kubernetes.py)."""

EXTRA_VARIABLES = {"BLINK_CACHE_DIR", "HF_HOME", "HF_TOKEN"}  # read by blink.shared.model_cache and huggingface_hub
