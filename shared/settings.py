"""Deployment settings: CLI flags override `BLINK_*` environment variables, which override the defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from blink.shared import drive_modes, grammar_backends, transports
from blink.shared.cpus import CPU_LIST
from blink.shared.quantization import QUANTIZATIONS
from blink.shared.request_schema import MAX_GRAMMAR_BYTES
from blink.shared.service_class import ClassDefaults, ClassName, ClassSLO
from blink.shared.speculative import HELP as SPECULATIVE_HELP
from blink.shared.speculative import SpeculativeConfig, speculative_config

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")  # blink.engine.core.policy
# How KV pages are stored (vLLM's --kv-cache-dtype): auto, the model's dtype; fp8 = fp8_e4m3 (engine/core/kv_dtype.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # blink.ingress.reasoning
# Variables a chat template gets from the request itself, which chat_template_kwargs may not replace.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})
# A list flag or variable: a JSON array, or (flags: one or more words; variables: one word) its items.
Names = Annotated[list[Annotated[str, Field(min_length=1)]], NoDecode]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BLINK_", extra="forbid")

    deployment: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="names the slot table and sockets")
    model: str | None = Field(None, description="a checkpoint directory, a .gguf file or a Hugging Face Hub id "
                              "(safetensors); unset: SmolLM2-135M-Instruct, fetched once into the cache")
    revision: str | None = Field(None, description="of a Hub model: a branch, tag or commit (default: main)")
    served_model_name: Names | None = Field(None, min_length=1, description="the names the model answers to "
                                            "(vLLM's; `--served-model-name a b`): requests may name any, responses "
                                            "and /v1/models report the first (default: the model's own name)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: str = "auto"
    dtype: str = "auto"
    load_format: Literal["auto", "dummy"] = Field("auto", description="auto: the checkpoint's weights; dummy: "
                                                  "random weights of their shapes (vLLM's; for benchmarks)")
    quantization: Literal[QUANTIZATIONS] | None = Field(
        None, description="weights in fewer bits (vLLM's flag): on the CPU, int8 (a scale per output channel) or int4 "
        "(groups of 32) quantize a float checkpoint on load; gguf runs a .gguf file's blocks (Q8_0, Q5_0/1, Q4_0/1, "
        "Q4_K, Q6_K) as stored; on a GPU, fp8 quantizes it to FP8 E4M3 with a scale per output channel (an FP8 "
        "checkpoint needs no flag) (default: the checkpoint's own weights)")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(
        "auto", description="how KV cache pages are stored (vLLM's flag): auto, the model's dtype; fp8 (= fp8_e4m3) "
        "or fp8_e5m2 store a byte an element with a per-layer scale (the checkpoint's k_scale/v_scale, else 1.0), "
        "twice the pages in the same memory; needs the Triton kernels (a GPU)")
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    num_pages: int | None = Field(None, ge=2)
    window: int = Field(64, ge=1, description="output tokens a slot buffers before the engine pauses it")
    max_grammar_bytes: int = Field(MAX_GRAMMAR_BYTES, ge=0, le=1 << 20, description="the largest structured-output "
                                   "spec a request may carry (a JSON schema, regex or grammar, UTF-8): each slot "
                                   "record holds this many bytes for it; 0 refuses structured outputs")
    structured_outputs_backend: Literal[grammar_backends.BACKENDS] = Field(grammar_backends.DEFAULT_BACKEND,
                                                                           description=grammar_backends.HELP)
    grammar_arena_bytes: int = Field(grammar_backends.GRAMMAR_ARENA_BYTES, ge=1 << 16, le=1 << 40, description=""
                                     "device memory the graph and persistent modes keep for structured outputs' "
                                     "grammar tables, every resident one together; a larger table is refused")
    max_waiting: int = Field(256, ge=0, description="requests that may wait for a slot before 429")
    api_key: str | None = Field(None, description="the key every client entry point asks for (HTTP `Authorization: "
                                "Bearer KEY`, the ZeroMQ API's `api_key`); /health, /ready and /metrics stay open")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="the largest request body the ingress reads; "
                                   "larger ones are answered 413 before they are read")
    request_timeout: float = Field(30.0, gt=0, description="seconds a client may take to send a request's headers, "
                                   "and again its body; a slower one is dropped (408 for a body)")
    shutdown_timeout: float = Field(30.0, ge=0)
    runtime_dir: str | None = Field(None, description="where the deployment's private directory (0700: IPC sockets, "
                                    "the generated control key) is made (default: $XDG_RUNTIME_DIR, else /tmp)")
    control_key: SecretStr | None = Field(None, description="the deployment's control-plane key: a z85 CURVE secret "
                                          "key (40 characters; `blink keygen`); every service of the deployment "
                                          "needs the same one")
    control_key_file: str | None = Field(None, description="a file holding the control key (compose: a secret; "
                                         "default: generated on first start into the private directory)")
    zmq_port: int | None = Field(None, ge=1, le=65535, description="TCP port of the ZeroMQ API (default: ipc)")
    transport: Literal[("auto", *transports.NAMES)] = Field("auto", description=transports.HELP)
    rdma_device: str | None = Field(None, description="RDMA device for the rdma transport (default: the first)")
    rdma_gid_index: int = Field(0, ge=0, description="GID index of the RDMA port (RoCE: the RoCEv2 entry)")
    ingress_cpus: str | None = Field(None, pattern=CPU_LIST, description="CPUs the ingress runs on (e.g. 0-1): "
                                     "cores of its own, as a SmartNIC's would be (default: any)")
    engine_cpus: str | None = Field(None, pattern=CPU_LIST, description="CPUs the engine process runs on "
                                    "(default: any)")
    engine_host: str = Field("127.0.0.1", description="where the engine runs, for --control-port/--relay-port")
    bind_host: str | None = Field(None, description="the interface the engine's TCP control and relay sockets "
                                  "listen on (default: --engine-host; 0.0.0.0 for every interface)")
    control_port: int | None = Field(None, ge=1, le=65535, description="TCP port of the engine's control socket "
                                     "(default: ipc, same host only)")
    relay_port: int | None = Field(None, ge=1, le=65535, description="TCP port of the engine host's relay for the "
                                   "zmq transport (default: ipc)")
    watchdog_deadline: float = Field(2.0, gt=0, description="seconds without a heartbeat or an answer before "
                                     "the watchdog declares a service stalled")
    engine_start_timeout: float = Field(600.0, gt=0, description="seconds an engine may take to load and answer")
    drive: Literal[("auto", *drive_modes.DRIVE_MODES)] = Field("auto", description=drive_modes.HELP)
    scheduling_policy: Literal[SCHEDULING_POLICIES] = Field(
        "slo", description="slo: latency-sensitive before best-effort, then priority, then TTFT deadline, with "
        "decodes kept within their TPOT SLOs; priority: vLLM's; fcfs: arrival order")
    swap_space: float = Field(4.0, ge=0, allow_inf_nan=False, description="GiB of host memory KV pages rotate "
                              "to when the pool runs short; 0: preempted requests are recomputed instead")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split over (Megatron's tensor "
                                      "parallelism; processes joined by torch.distributed: NCCL on GPUs, gloo on "
                                      "the CPU); more than one runs the host drive mode")
    enable_prefix_caching: bool = Field(True, description="requests share the KV of equal prompt prefixes (cached "
                                        "pages kept until the pool needs them); --no-enable-prefix-caching: off")
    compile_bookkeeping: bool = Field(False, description="the step's admission, planning and commit compiled by "
                                      "torch.compile (fused into tens of kernels from hundreds of ops), in the graph "
                                      "and persistent drive modes (compiled before serving); the offline API's "
                                      "LLM(compile_bookkeeping=True) runs it on the CPU too")
    speculative_config: Annotated[SpeculativeConfig | None, NoDecode] = Field(None, description=SPECULATIVE_HELP)
    enable_auto_tool_choice: bool = Field(False, description="find tool calls in chat output (tool_choice auto), "
                                          "with --tool-call-parser (vLLM's flags)")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None, description="how the model writes tool calls: hermes (<tool_call> JSON: Hermes, Qwen) or llama3_json")
    reasoning_parser: Literal[REASONING_PARSERS] | None = Field(
        None, description="split a reasoning model's <think> text out of chat content into reasoning_content "
        "(vLLM's): qwen3 or deepseek_r1")
    chat_template: str | None = Field(None, description="a Jinja chat template, or a file holding one, used instead "
                                      "of the checkpoint's (vLLM's; inline, \\n is a newline)")
    default_chat_template_kwargs: Annotated[dict[str, Any], NoDecode] = Field(
        default_factory=dict, description="a JSON object of variables every chat template render gets (e.g. "
        "'{\"enable_thinking\": false}'); a request's chat_template_kwargs override them (vLLM's)")
    generation_config: str = Field("auto", description="auto: the checkpoint's generation_config.json "
                                   "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) are the "
                                   "defaults of requests that omit them; vllm: ignore it; else a directory holding "
                                   "one (vLLM's)")
    allowed_origins: Names | None = Field(None, description="answer browsers' cross-origin requests (CORS) from "
                                          "these origins (e.g. '[\"*\"]'); unset, no CORS headers at all, so web "
                                          "pages elsewhere cannot read the API with a visitor's network access "
                                          "(vLLM's defaults to every origin)")
    allowed_methods: Names = Field(["*"], description="the methods CORS allows, with --allowed-origins")
    allowed_headers: Names = Field(["*"], description="the request headers CORS allows, with --allowed-origins")
    allow_credentials: bool = Field(False, description="CORS requests may carry cookies and Authorization, with "
                                    "--allowed-origins")
    default_class: ClassName = Field("latency_sensitive", description="service class of requests that name none")
    ls_ttft_slo_ms: float | None = Field(None, gt=0, description="latency-sensitive requests' default TTFT SLO")
    ls_tpot_slo_ms: float | None = Field(None, gt=0, description="latency-sensitive requests' default TPOT SLO")
    be_ttft_slo_ms: float | None = Field(None, gt=0, description="best-effort requests' default TTFT SLO")
    be_tpot_slo_ms: float | None = Field(None, gt=0, description="best-effort requests' default TPOT SLO")
    ls_reserved_slots: int | None = Field(None, ge=0, description="slots only latency-sensitive requests may take "
                                          "(default: an eighth of them)")

    @field_validator("model", "revision", "served_model_name", "api_key", "rdma_device", "runtime_dir", "control_key",
                     "control_key_file", "bind_host", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """BLINK_MODEL= (as compose writes an unset ${BLINK_MODEL:-}) means the default, not a model named ''."""
        return None if value == "" else value

    @field_validator("served_model_name", "allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _list(cls, value: object) -> object:
        """A JSON array (`--allowed-origins '["*"]'`, a variable), or the items themselves (`--served-model-name a
        b`, BLINK_SERVED_MODEL_NAME=name); empty, unset (as compose writes an unset variable)."""
        if value == "":
            return None
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0] if value[0].lstrip().startswith("[") else value
        if isinstance(value, str):
            return _json(value, "a JSON array") if value.lstrip().startswith("[") else [value]
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, value: object) -> SpeculativeConfig | None:
        return speculative_config(value)

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, value: object) -> object:
        value = _json(value, "a JSON object") if isinstance(value, str) else value
        if isinstance(value, dict) and (reserved := RESERVED_TEMPLATE_VARIABLES & value.keys()):
            raise ValueError(f"may not set {', '.join(sorted(reserved))}: each request gives its own")
        return value

    @model_validator(mode="after")
    def _tool_choice_needs_a_parser(self) -> Settings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
        return self

    def class_defaults(self) -> ClassDefaults:
        return ClassDefaults(
            default_class=self.default_class,
            latency_sensitive=ClassSLO(ttft_slo_ms=self.ls_ttft_slo_ms, tpot_slo_ms=self.ls_tpot_slo_ms),
            best_effort=ClassSLO(ttft_slo_ms=self.be_ttft_slo_ms, tpot_slo_ms=self.be_tpot_slo_ms))

    def reserved_slots(self, num_slots: int) -> int:
        """Only the slo policy tells classes apart; under the others the ingress keeps one line, no reserve."""
        if self.scheduling_policy != "slo":
            return 0
        return num_slots // 8 if self.ls_reserved_slots is None else self.ls_reserved_slots

    @property
    def by_class(self) -> bool:
        return self.scheduling_policy == "slo"

    @property
    def private_dir(self) -> Path:
        """The deployment's runtime directory: its IPC sockets and generated key (blink.shared.sockets)."""
        parent = self.runtime_dir or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        return Path(parent) / f"blink-{self.deployment}"

    @property
    def engine_pid_file(self) -> Path:
        """Where the engine process writes its pid as it starts: a watchdog that did not start it (compose) can
        kill one that hangs before its handshake."""
        return self.private_dir / "engine.pid"

    @property
    def control_endpoint(self) -> str:
        return self._endpoint("control", self.control_port)

    @property
    def relay_endpoint(self) -> str:
        return self._endpoint("relay", self.relay_port)

    @property
    def ingress_control_endpoint(self) -> str:
        return self._endpoint("ingress")

    @property
    def events_endpoint(self) -> str:
        """The watchdog's PUB socket: one JSON event per frame."""
        return self._endpoint("events")

    @property
    def zmq_endpoint(self) -> str:
        """The ingress's ZeroMQ API, served on its own host."""
        return f"tcp://{self.host}:{self.zmq_port}" if self.zmq_port else self._endpoint("api")

    def _endpoint(self, name: str, port: int | None = None) -> str:
        """A socket of the engine host: TCP when it has a port, else IPC in the private directory (same host)."""
        if port:
            return f"tcp://{self.engine_host}:{port}"
        return f"ipc://{self.private_dir}/{name}"

    def bind_address(self, endpoint: str) -> str:
        """What the engine binds for an endpoint others connect to: --bind-host, for TCP, when given."""
        if self.bind_host is None or not endpoint.startswith("tcp://"):
            return endpoint
        return f"tcp://{self.bind_host}:{endpoint.rsplit(':', 1)[1]}"


def _json(text: str, kind: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"not {kind} ({e})") from None
