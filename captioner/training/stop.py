"""Ctrl-C and SIGTERM during training: finish the step, checkpoint, stop (a second signal stops at once)."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class StopRequest:
    """Ctrl-C (SIGINT) and SIGTERM during training: the first one lets the current step finish, then
    the run writes `last.pt` at that exact position and ends (`signal` says which arrived); a second
    one stops at once (KeyboardInterrupt, or exit 143), a checkpoint being written is then abandoned
    and the previous one stays. Handlers are installed only in the main thread, and restored after."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signum
            log.warning("%s: finishing this step, then writing last.pt (again to stop at once)",
                        signal.Signals(signum).name)
            return
        self.__exit__()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)
