"""Building an engine from a checkpoint: model, page pool, slot state and step, sized for the device."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from blink.engine.core import kv_dtype
from blink.engine.core.draft_model import DraftModel, load_draft
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import policy_named
from blink.engine.core.prefix_cache import PrefixCache
from blink.engine.core.rotation import HostMirror
from blink.engine.core.speculation import Speculation
from blink.engine.core.state import Slots
from blink.engine.core.step import Step
from blink.engine.device import auto_dtype, available_memory, configure_threads, resolve_device
from blink.engine.model import fp8, quant
from blink.engine.model.checkpoint import load_config, read_generation_defaults
from blink.engine.model.config import DTYPES, ModelConfig
from blink.engine.model.model import LOAD_FORMATS, Transformer
from blink.engine.model.parallel import Shard
from blink.engine.ranks import meet
from blink.shared.checkpoints.source import resolve
from blink.shared.grammar_backends import BACKENDS, DEFAULT_BACKEND, GRAMMAR_ARENA_BYTES
from blink.shared.prefix_hash import prefix_seed
from blink.shared.request_schema import MAX_GRAMMAR_BYTES
from blink.shared.slot_table import Geometry
from blink.shared.speculative import SpeculativeConfig, speculative_config
from blink.shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str | None = None  # a checkpoint directory, .gguf file or Hub id (source.resolve); None: the default
    revision: str | None = None  # of a Hub model: a branch, tag or commit (default: main)
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    device: str = "auto"
    max_num_seqs: int | None = None  # slot limit S
    max_num_batched_tokens: int | None = None  # token budget T per step
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size, the null page included
    kv_memory_fraction: float | None = None  # of the device's free memory after loading weights
    seed: int = 0  # seeds requests that bring none
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights of their shapes (vLLM's)
    quantization: str | None = None  # int8 | int4 | fp8 (quantized on load) | gguf (a GGUF's blocks): quant.py, fp8.py
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2: engine/core/kv_dtype.py
    scheduling_policy: str = "slo"  # fcfs | priority | slo (blink.engine.core.policy)
    swap_space: float = 4.0  # GiB of host memory for KV rotation; 0: recompute preempted requests instead
    enable_prefix_caching: bool = True  # requests share the KV pages of equal prompt prefixes (vLLM's default)
    compile_bookkeeping: bool = False  # admission, plan and commit through torch.compile (Step.compile_bookkeeping)
    tensor_parallel_size: int = 1  # ranks the model is split over (blink.engine.model.parallel)
    tensor_parallel_rank: int = 0  # this engine's (the LLM API starts the others)
    distributed_init_method: str | None = None  # where the ranks meet: tcp://HOST:PORT
    structured_outputs_backend: str = DEFAULT_BACKEND  # the grammar library (blink.shared.grammar_backends)
    grammar_arena_bytes: int = GRAMMAR_ARENA_BYTES  # the device modes' grammar tables (engine/drive/device_grammars.py)
    # vLLM's --speculative-config: a dict or its JSON ({"method": "ngram", "num_speculative_tokens": K, ...}, or
    # {"model": DRAFT, ...}); None: off (blink.shared.speculative, engine/core/speculation.py, draft_model.py)
    speculative_config: dict | str | None = None

    def validate(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        policy_named(self.scheduling_policy)  # raises on an unknown name
        kv_dtype.storage(self.kv_cache_dtype, torch.float32)  # raises on an unknown name
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be a finite number of GiB, at least 0, got {self.swap_space}")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_rank must be in [0, {self.tensor_parallel_size}), got "
                             f"{self.tensor_parallel_rank}")
        if self.structured_outputs_backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.structured_outputs_backend!r}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        spec = speculative_config(self.speculative_config)  # raises on a config that is not one
        if spec is not None and spec.model is not None and self.tensor_parallel_size > 1:
            raise ValueError("a draft model runs on one rank: speculative decoding with a draft model needs "
                             "tensor_parallel_size 1 (method ngram drafts on any)")

    @property
    def speculation(self) -> SpeculativeConfig | None:
        return speculative_config(self.speculative_config)


class Engine:
    def __init__(self, config: EngineConfig, lost_rank: Callable[[], str | None] | None = None):
        """lost_rank: with tensor parallelism, rank 0's way to learn why another rank is gone (Ranks.lost), so that
        it does not wait for a rank that died before joining."""
        config.validate()
        self.config = config
        configure_threads(config.tensor_parallel_size)
        self.device = resolve_device(config.device)
        on_cuda = self.device.type == "cuda"
        if on_cuda and config.tensor_parallel_size > 1 and config.device == "auto":  # a GPU per rank
            self.device = torch.device("cuda", config.tensor_parallel_rank)
        if on_cuda:  # Triton launches on the current device, whatever its tensors' (--device cuda:1)
            torch.cuda.set_device(self.device)
        self.shard = _join_ranks(config, self.device, lost_rank)
        checkpoint = resolve(config.model, revision=config.revision, check=load_config)
        self.model_dir, self.model_name = checkpoint.path, checkpoint.name

        cfg = load_config(self.model_dir)
        dtype = auto_dtype(cfg.dtype, self.device) if config.dtype == "auto" else DTYPES[config.dtype]
        cfg = dataclasses.replace(cfg, dtype=dtype)
        self.model_config = cfg
        self.tokenizer = Tokenizer(self.model_dir)
        self.generation = read_generation_defaults(self.model_dir)

        max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_slots = config.max_num_seqs or (256 if on_cuda else 32)
        budget = config.max_num_batched_tokens or max(2048 if on_cuda else 512, num_slots)
        if budget < num_slots:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be at least max_num_seqs ({num_slots}), "
                             "so every running sequence can decode in one step")
        page = config.page_size

        if config.quantization != "fp8":  # the CPU's formats; FP8's rules are fp8.check's
            quant.check(config.quantization, self.device, config.load_format, config.tensor_parallel_size)
        fp8.check(config.quantization, cfg.fp8, config.tensor_parallel_size)
        kv_dtype.check(config.kv_cache_dtype, self.device)  # before the weights load: minutes for a large model
        self.kv_dtype = kv_dtype.storage(config.kv_cache_dtype, cfg.dtype)
        self.model = Transformer.from_checkpoint(self.model_dir, cfg, max_len, self.device, config.load_format,
                                                 self.shard, config.quantization)
        if self.kv_dtype != cfg.dtype and self.model.kernels.name != "triton":  # never read FP8 pages wrong
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} needs the Triton kernels, not "
                             f"{self.model.kernels.name}'s")
        spec = config.speculation
        draft = spec and load_draft(spec, cfg, self.tokenizer, max_len, self.device, config.load_format)
        if draft and draft.cfg.max_position_embeddings < max_len:  # the draft reads no further
            if config.max_model_len:
                raise ValueError(f"the draft model reads {draft.cfg.max_position_embeddings} positions at most: set "
                                 f"max_model_len to at most that, not {max_len}")
            max_len = draft.cfg.max_position_embeddings
            log.info("context limit lowered to %d tokens, the draft model's", max_len)
        if on_cuda:  # the loading's staging copies go back to the device before the KV pool is sized from what is free
            torch.cuda.empty_cache()
        pages_per_seq = -(-max_len // page)
        draft_page = PagePool.bytes_per_page(draft.cfg, page) if draft else 0  # a page holds the draft's KV too
        num_pages = config.num_pages or self._pages_that_fit(self.model.cfg, page, num_slots * pages_per_seq + 1,
                                                             draft_page)
        if self.shard is not None and not config.num_pages:
            # Each rank sized its pool from its own free memory; ranks whose pools differed would schedule
            # differently and stop meeting in the collectives. All take the smallest.
            num_pages = self.shard.smallest(num_pages, self.device)
        if (num_pages - 1) * page < max_len:
            if config.max_model_len:
                raise ValueError(f"max_model_len {max_len} needs {pages_per_seq} KV pages of {page} tokens, "
                                 f"but the pool has {num_pages - 1}")
            max_len = (num_pages - 1) * page
            pages_per_seq = num_pages - 1
            log.info("context limit lowered to %d tokens to fit the KV pool", max_len)
        self.max_model_len = max_len
        cache = PrefixCache(num_pages, page, self.device) if config.enable_prefix_caching else None
        scales = kv_dtype.checkpoint_scales(self.model_dir, cfg.num_layers) if self.kv_dtype != cfg.dtype else None
        self.pool = PagePool(self.model.cfg, num_pages, page, self.device, cache, self.kv_dtype, scales)  # this rank's
        if scales is not None:  # each layer's attention reads its own K and V scale (a view of the pool's)
            for w, layer_scales in zip(self.model.layers, self.pool.scales, strict=True):
                w.kv_scales = layer_scales
        # What the KV of a page depends on besides its tokens: the root of every page hash requests carry.
        stored = str(cfg.dtype) if self.kv_dtype == cfg.dtype else f"{cfg.dtype} as {self.kv_dtype}"
        self.prefix_seed = prefix_seed(str(self.model_dir.resolve()), stored, str(page))
        self.state = Slots(num_slots, max_len, pages_per_seq, cfg.vocab_size, self.device)
        mirror_pages = min(int(config.swap_space * 2**30) // (self.pool.page_bytes + draft_page),  # both KVs
                           num_slots * pages_per_seq) + 1
        self._mirror_pages = mirror_pages if config.swap_space > 0 and mirror_pages > 1 else 0
        drafter = DraftModel(draft, num_pages, page) if draft else None
        self.step = Step(self.model, self.pool, self.state, list(self.generation.eos_token_ids), budget,
                         policy_named(config.scheduling_policy), self.shard,
                         Speculation.of(spec, cfg, self.model.kernels.name == "cpu",
                                        drafter.cost_ratio(self.model) if drafter else 0.0) if spec else None,
                         drafter)
        if config.compile_bookkeeping:
            self.step.compile_bookkeeping()
        log.info("engine ready: %s on %s in %s (dtype %s), %d slots, %d-token budget, %d KV pages of %d in %s, "
                 "context %d, %s scheduling, %d host pages for KV rotation, prefix caching %s, bookkeeping %s, "
                 "speculation %s",
                 cfg.architecture, self.device, str(cfg.dtype).removeprefix("torch."), config.dtype, num_slots, budget,
                 num_pages, page, str(self.kv_dtype).removeprefix("torch."), max_len, config.scheduling_policy,
                 max(0, self._mirror_pages - 1),
                 "on" if config.enable_prefix_caching else "off", "compiled" if config.compile_bookkeeping else "eager",
                 spec.model_dump(exclude_none=True) if spec else "off")

    def geometry(self, window: int, max_prompt_tokens: int | None = None,
                 max_grammar_bytes: int = MAX_GRAMMAR_BYTES) -> Geometry:
        """The slot table this engine reads: its slots, prompts up to its context limit (or fewer), its page size
        and prefix seed, so the page hashes the ingress writes are this engine's, and grammars up to
        `max_grammar_bytes`."""
        return Geometry(self.state.num_slots, max_prompt_tokens or self.max_model_len, window,
                        page_size=self.pool.page_size, prefix_seed=self.prefix_seed,
                        max_grammar_bytes=max_grammar_bytes)

    def check_geometry(self, g: Geometry) -> None:
        """Raises unless this engine can serve a slot table of geometry `g`: as many slots, page hashes made for
        its pages."""
        if g.num_slots != self.state.num_slots:
            raise ValueError("the slot table and the engine must have as many slots")
        if g.page_size != self.pool.page_size:  # its hashes would name other token spans than this pool's pages
            raise ValueError(f"the slot table hashes prompts in pages of {g.page_size} tokens, the engine's pages "
                             f"hold {self.pool.page_size}: make its geometry with Engine.geometry")

    @cached_property
    def mirror(self) -> HostMirror | None:
        """The host memory KV pages rotate to (--swap-space), made when a driver that rotates first asks for it (the
        host mode's loop, or the device step, which maps it for its rotation kernels)."""
        drafter = self.step.drafter
        draft = (drafter.k, drafter.v) if drafter is not None else None
        return HostMirror(self.pool, self._mirror_pages, draft) if self._mirror_pages else None

    def _pages_that_fit(self, cfg: ModelConfig, page: int, useful: int, draft_page: int = 0) -> int:
        fraction = self.config.kv_memory_fraction or (0.9 if self.device.type == "cuda" else 0.25)
        per_page = PagePool.bytes_per_page(cfg, page, self.kv_dtype) + draft_page
        return max(2, min(useful, int(available_memory(self.device) * fraction) // per_page))


def _join_ranks(config: EngineConfig, device: torch.device, lost_rank: Callable[[], str | None] | None) -> Shard | None:
    """With tensor parallelism, this engine's rank joins the others: gloo on the CPU; on GPUs NCCL for device
    tensors and gloo for host ones (the offline API's records and clock)."""
    if config.tensor_parallel_size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        if config.distributed_init_method is None:
            raise ValueError("tensor parallelism needs distributed_init_method (tcp://HOST:PORT), where ranks meet")
        meet(partial(dist.init_process_group, "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                     init_method=config.distributed_init_method, rank=config.tensor_parallel_rank,
                     world_size=config.tensor_parallel_size), lost_rank)
    return Shard(config.tensor_parallel_rank, config.tensor_parallel_size)
