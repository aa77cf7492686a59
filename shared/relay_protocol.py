"""The `zmq` transport's frames between a remote ingress (DEALER) and the engine host's relay (ROUTER).

One JSON object per frame. Ingress to relay: {"op": "submit", "id", "request"}, {"op": "cancel", "id"},
{"op": "health"}, {"op": "adopt", "streams": {id: slot}} (a switch of transport). Relay to ingress: {"id",
"slot", "relay"} once published, {"id", "out"} per batch of outputs (the last one carries the finish), {"id",
"error"} when refused ("overloaded", or why), {"health"} answering a probe. "relay" names the relay's life: a
request accepted by an earlier one died with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from blink.shared.slot_table import Finish, Output, Request, RequestStats


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict:
    message = json.loads(frame)
    if not isinstance(message, dict):
        raise ValueError("a relay frame must be a JSON object")
    return message


def request_to_wire(request: Request) -> dict:
    return asdict(request)


def request_from_wire(fields: dict) -> Request:
    return Request(**{**fields, "stop_token_ids": tuple(fields.get("stop_token_ids", ()))})


def output_to_wire(out: Output) -> dict:
    return {**asdict(out), "finish": int(out.finish)}


def output_from_wire(fields: dict) -> Output:
    stats = fields.get("stats")
    return Output(fields["tokens"], fields["logprobs"], fields["top_ids"], fields["top_logprobs"],
                  Finish(fields["finish"]), RequestStats(**stats) if stats else None)
