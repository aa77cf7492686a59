"""Cross-origin requests from browsers (CORS), as vLLM's --allowed-origins and friends allow them; none unless
--allowed-origins names some, so a web page elsewhere cannot read the API through a visitor's browser."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from blink.shared.settings import Settings


@dataclass(frozen=True)
class CorsPolicy:
    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool = False

    @classmethod
    def of(cls, settings: Settings) -> CorsPolicy | None:
        if not settings.allowed_origins:
            return None
        return cls(settings.allowed_origins, settings.allowed_methods, settings.allowed_headers,
                   settings.allow_credentials)

    def install(self, app: FastAPI) -> None:
        """Outermost (added last): preflights are answered before the API key is asked, and refusals (401, 429)
        carry the headers a browser needs to read them."""
        app.add_middleware(CORSMiddleware, allow_origins=self.origins, allow_methods=self.methods,
                           allow_headers=self.headers, allow_credentials=self.credentials)
