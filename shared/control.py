"""Control-plane messages (pydantic) and their ZeroMQ framing: one JSON frame per message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter

from blink.shared.service_class import ClassDefaults, ClassName, ClassSLO
from blink.shared.slot_table import Geometry
from blink.shared.transports import LAST_RESORT

if TYPE_CHECKING:
    from blink.shared.sockets import Keys


class Hello(BaseModel):
    type: Literal["hello"] = "hello"


class GetStatus(BaseModel):
    type: Literal["status"] = "status"


class SetLimits(BaseModel):
    """Admission limits the engine applies from its next step on."""

    type: Literal["set_limits"] = "set_limits"
    max_running: int | None = Field(None, ge=0, description="requests admitted at once; None: every slot")


class SetClassDefaults(BaseModel):
    """The ingress's default class and per-class SLOs, from its next request on: what is given replaces what it
    names (a class's SLOs as a whole), what is left out stays. Answered with the resulting ClassDefaultsNow."""

    type: Literal["set_class_defaults"] = "set_class_defaults"
    default_class: ClassName | None = None
    latency_sensitive: ClassSLO | None = None
    best_effort: ClassSLO | None = None

    def applied_to(self, defaults: ClassDefaults) -> ClassDefaults:
        given = self.model_dump(exclude={"type"}, exclude_none=True)
        return ClassDefaults.model_validate({**defaults.model_dump(), **given})


class ClassDefaultsNow(BaseModel):
    type: Literal["class_defaults"] = "class_defaults"
    defaults: ClassDefaults


class RdmaPeer(BaseModel):
    """One end of a reliable-connected queue pair: what the other end needs to connect to it."""

    device: str
    port: int
    gid: str  # RoCE routes by GID; InfiniBand by LID
    lid: int
    qp_num: int
    psn: int


class RdmaConnect(BaseModel):
    """The ingress asks for a queue pair into the slot table (the `rdma` transport)."""

    type: Literal["rdma_connect"] = "rdma_connect"
    peer: RdmaPeer


class RdmaAccept(BaseModel):
    """The engine's end, and where the table is: its registered address, key and geometry, and the epoch."""

    type: Literal["rdma_accept"] = "rdma_accept"
    peer: RdmaPeer
    address: int
    rkey: int
    size: int
    geometry: Geometry
    epoch: int


class Drain(BaseModel):
    """The engine reports itself draining (/ready answers 503) until a Resume."""

    type: Literal["drain"] = "drain"


class Resume(BaseModel):
    type: Literal["resume"] = "resume"


class Stop(BaseModel):
    type: Literal["stop"] = "stop"


class Ping(BaseModel):
    """The watchdog's liveness probe of the ingress: an answer means its event loop is turning."""

    type: Literal["ping"] = "ping"


class SwitchTransport(BaseModel):
    """Moves the ingress to another transport without losing requests: those in flight are adopted by it."""

    type: Literal["switch_transport"] = "switch_transport"
    transport: Literal[LAST_RESORT]  # the one transport that takes requests over


class IngressStatus(BaseModel):
    type: Literal["ingress_status"] = "ingress_status"
    pid: int
    running: int
    waiting: int
    failovers: int
    draining: bool
    transport: str
    transport_lost: str | None = None  # why, while the ingress cannot reach the table through its transport


class EngineInfo(BaseModel):
    type: Literal["engine_info"] = "engine_info"
    slot_table: str
    num_slots: int
    epoch: int
    served_model_names: list[str] = Field(min_length=1)  # what requests may name; the first is the one reported
    model_dir: str  # where the ingress finds the tokenizer and chat template
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    drive: str
    pid: int
    rank_pids: list[int] = []  # with tensor parallelism, the other ranks' processes (this pid is rank 0's)
    scheduling_policy: str = "slo"
    kv_host_pages: int = 0  # the host mirror KV pages rotate to; 0: recompute only
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # how KV pages are stored (--kv-cache-dtype)
    limitations: list[str] = []  # what the drive mode does not do yet (blink.engine.drive.driver.Driver)
    max_grammar_bytes: int = 0  # the largest structured-output spec a record holds; 0: none

    @property
    def model(self) -> str:
        """The model's name, as responses, /v1/models and the metrics give it."""
        return self.served_model_names[0]

    def policies(self) -> dict[str, str]:
        """How the engine schedules, in words: the start-up log and blink:engine_info's labels say it."""
        return {"scheduling_policy": self.scheduling_policy, "kv_rotation": "on" if self.kv_host_pages else "off",
                "prefix_caching": "on" if self.prefix_caching else "off", "kv_cache_dtype": self.kv_cache_dtype}


class EngineStatus(BaseModel):
    type: Literal["engine_status"] = "engine_status"
    state: str
    epoch: int
    steps: int
    running: int
    kv_pages_used: int
    kv_pages_total: int
    preemptions: int
    kv_host_pages_used: int = 0  # the host mirror KV pages rotate to
    kv_host_pages_total: int = 0
    # Speculative decoding's counters since the start, as vLLM names them (engine/core/speculation.py).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = Field(default_factory=list)  # per draft position
    # Constrained records the engine ended (blink.engine.core.grammar.ENDED_REASONS: failed, timeout), since the start.
    structured_output_ended: dict[str, int] = Field(default_factory=dict)
    # The device modes' grammar arena (blink.engine.drive.device_grammars): bytes its resident tables take, its size
    # (--grammar-arena-bytes), and those tables (one per spec). All 0 where the engine has none (the host mode).
    grammar_arena_bytes_used: int = 0
    grammar_arena_bytes_total: int = 0
    grammar_tables_resident: int = 0


class Ack(BaseModel):
    type: Literal["ack"] = "ack"


class Failure(BaseModel):
    type: Literal["error"] = "error"
    message: str


Message = Annotated[Hello | GetStatus | SetLimits | SetClassDefaults | ClassDefaultsNow | RdmaConnect | RdmaAccept
                    | Drain | Resume | Stop | Ping | SwitchTransport | IngressStatus | EngineInfo | EngineStatus
                    | Ack | Failure, Field(discriminator="type")]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode()


def decode(frame: bytes) -> Message:
    return _adapter.validate_json(frame)


def request(endpoint: str, message: BaseModel, keys: Keys, timeout_s: float = 1.0) -> Message:
    """One request/reply over a fresh REQ socket, as a member of the deployment (`keys`); raises TimeoutError when
    nobody answers in time (or the server turned the key away)."""
    import zmq

    from blink.shared import sockets

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sockets.connect(sock, endpoint, keys)
        sock.send(encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from {endpoint} within {timeout_s} s")
        return decode(sock.recv())
    finally:
        sock.close()
