"""Models named by a Hugging Face Hub id, through `huggingface_hub`: its cache, HF_HOME, HF_TOKEN and HF_HUB_OFFLINE.

safetensors only (no pickled .bin weights). The small files come first and are checked (an architecture or a
quantization Blink cannot run is refused before gigabytes of weights are fetched).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from blink.shared.checkpoints.errors import CheckpointError

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "config.json", "special_tokens_map.json"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]


def snapshot(repo_id: str, revision: str | None, weights: bool, check: Callable[[Path], object] | None) -> Path:
    """The local snapshot directory of repo_id at revision (default: main), downloaded as needed."""
    small = _download(repo_id, revision, TOKENIZER_FILES)
    if not weights:
        return small
    if check is not None:
        check(small)
    return _download(repo_id, revision, TOKENIZER_FILES + WEIGHT_FILES)


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise CheckpointError(f"{repo_id}: a gated repository; accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: not a local directory or file, and no such model on the Hub (or it is "
                              "private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"{repo_id}: not in the local Hub cache, and the Hub cannot be reached "
                              f"(HF_HUB_OFFLINE, or no network): {e}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{repo_id}: the Hub download failed: {e}") from None
