"""uvicorn's HTTP protocol with a deadline on a request's headers: a client that trickles them (slowloris) or opens a
connection and says nothing is disconnected, rather than holding the connection for good. uvicorn bounds their
size, not their time; the body's time is the guard's (blink.ingress.guard)."""

from __future__ import annotations

from asyncio import TimerHandle, Transport

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def with_header_deadline(timeout_s: float) -> type[HttpToolsProtocol]:
    class HeaderDeadline(HttpToolsProtocol):
        _deadline: TimerHandle | None = None

        def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a new connection owes its first request's headers too

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:  # no request in hand: nothing to answer
                self.transport.close()

    return HeaderDeadline
