"""Service classes and their SLO defaults: latency-sensitive work is served before best-effort work.

A request names its class in the body (`service_class`) or the `x-blink-class` header; one that names none gets
the deployment's default class. SLOs a request does not set come from its class's defaults, which the control
plane may change while serving. Both sides import this: the ingress resolves a request's class and SLOs, the
engine schedules on them.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class ServiceClass(IntEnum):
    LATENCY_SENSITIVE = 0  # lower is served first
    BEST_EFFORT = 1

    @property
    def label(self) -> str:
        return CLASS_LABELS[self]


CLASS_LABELS = {ServiceClass.LATENCY_SENSITIVE: "latency_sensitive", ServiceClass.BEST_EFFORT: "best_effort"}
CLASS_NAMES = {"latency_sensitive": ServiceClass.LATENCY_SENSITIVE, "latency-sensitive": ServiceClass.LATENCY_SENSITIVE,
               "ls": ServiceClass.LATENCY_SENSITIVE, "best_effort": ServiceClass.BEST_EFFORT,
               "best-effort": ServiceClass.BEST_EFFORT, "be": ServiceClass.BEST_EFFORT}
ClassName = Annotated[Literal[tuple(CLASS_NAMES)], BeforeValidator(lambda v: v.strip().lower() if isinstance(v, str)
                                                                   else v)]


def parse_class(name: str) -> ServiceClass:
    try:
        return CLASS_NAMES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown service class {name!r}: latency_sensitive (ls) or best_effort (be)") from None


class ClassSLO(BaseModel):
    """A class's default SLOs in milliseconds; None: requests of the class have none unless they set one."""

    model_config = ConfigDict(extra="forbid")

    ttft_slo_ms: float | None = Field(None, gt=0)
    tpot_slo_ms: float | None = Field(None, gt=0)


class ClassDefaults(BaseModel):
    """The default class and each class's default SLOs."""

    model_config = ConfigDict(extra="forbid")

    default_class: ClassName = "latency_sensitive"
    latency_sensitive: ClassSLO = ClassSLO()
    best_effort: ClassSLO = ClassSLO()

    def slo(self, service_class: ServiceClass) -> ClassSLO:
        return getattr(self, service_class.label)

    def resolve(self, named: str | None, ttft_slo_ms: float | None,
                tpot_slo_ms: float | None) -> tuple[ServiceClass, float | None, float | None]:
        """A request's class and SLOs: what it set, else its class's defaults."""
        service_class = parse_class(named or self.default_class)
        slo = self.slo(service_class)
        return (service_class, ttft_slo_ms if ttft_slo_ms is not None else slo.ttft_slo_ms,
                tpot_slo_ms if tpot_slo_ms is not None else slo.tpot_slo_ms)
