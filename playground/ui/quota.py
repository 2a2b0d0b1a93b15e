"""A public app's cap on generated tokens per visitor: runs share one processor, so one visitor's 4,096-token runs
must not hold everyone else's queue. Local apps have no cap."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Any

from ..config import ConfigError

TOKENS_PER_HOUR = 20_000  # about ten minutes of one CPU's plain decoding
WINDOW_S = 3600.0


class Quota:
    """Tokens each visitor (the address the request came from) generated over the last hour; None: no cap."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.used: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self.lock = threading.Lock()

    def take(self, request: Any, tokens: int, field: str = "max_new_tokens") -> None:
        """Count a run of `tokens` generated tokens against its visitor, or refuse it naming the field."""
        if self.limit is None:
            return
        visitor = _visitor(request)
        with self.lock:
            spent = self.used[visitor]
            while spent and spent[0][0] < time.monotonic() - WINDOW_S:
                spent.popleft()
            left = self.limit - sum(n for _, n in spent)
            if tokens > left:
                raise ConfigError(f"{field}: this public app generates at most {self.limit} tokens per visitor an "
                                  f"hour; this run needs {tokens} and {max(left, 0)} are left (run it locally for "
                                  "no cap)")
            spent.append((time.monotonic(), tokens))


def _visitor(request: Any) -> str:
    """The client's address: the first hop a proxy forwarded (a Space sits behind one), else the socket's."""
    headers = getattr(request, "headers", None) or {}
    forwarded = headers.get("x-forwarded-for", "")
    if forwarded:
        return forwarded.split(",")[0].strip()
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or getattr(request, "session_hash", None) or "anonymous"


QUOTA = Quota()  # build_app sets its limit for a public app
