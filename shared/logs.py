"""structlog set up for JSON lines; bind `request_id` with structlog.contextvars to carry it."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: int = logging.INFO) -> None:
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(),
    ]
    structlog.configure(processors=processors, wrapper_class=structlog.make_filtering_bound_logger(level),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr), cache_logger_on_first_use=True)
    structlog.contextvars.bind_contextvars(service=service)
    # Standard-library loggers (the engine's, uvicorn's) go through the same JSON renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.JSONRenderer()],
        foreign_pre_chain=processors[:-1]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
