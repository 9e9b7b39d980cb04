"""An asyncio event loop running in a thread of its own.

Synchronous test code (hypothesis drives its examples synchronously) uses it to run real async
services (registry, router, stand-in engines) and to call into them without blocking their loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """``with LoopThread() as loop: loop.run(coro)`` runs ``coro`` on the thread's loop."""

    def __init__(self, name: str = "kvferry-testing-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def start(self) -> LoopThread:
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        """Runs ``coro`` on the loop and waits for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
