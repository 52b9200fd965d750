"""Which instance the agent reports to: every instance serving the node's segment is
listed (kernel command line, then the server's answers); the agent stays with one while it
answers and moves round the list when it stops. An answer lists the node's owner first (the
instance that judges its heartbeats): the agent moves there, unless that one is the server
it just left for not answering. Decisions only: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence

SHUN = 6  # answers before the agent follows an answer back to a server that failed it


class Servers:
    """The instances, in order, and the one in use. A move is decided on a failure that is
    no answer (refused, timed out, 5xx); a 403 or 404 is an answer and moves nothing."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(urls)
        self.current = self.urls[0]
        self._failed: set[str] = set()  # servers that failed since one last answered
        self._shunned: dict[str, int] = {}  # failed servers: answers left before a return

    def update(self, urls: Sequence[str]) -> bool:
        """The list from an answer (an instance joined or left); the one in use stays in
        use while it answers, listed or not. True when the list changed."""
        changed = tuple(urls) != self.urls
        self.urls = tuple(urls)
        self._shunned = {url: left for url, left in self._shunned.items() if url in self.urls}
        return changed

    def lead(self) -> str | None:
        """The list's first (the node's owner, by the last answer) when it is not the one in
        use: the one to move to, or None. One that failed the agent is followed only after
        SHUN answers from another (its owner record outlives it by a lease's TTL)."""
        first = self.urls[0]
        if first == self.current:
            return None
        left = self._shunned.get(first, 0)
        if left > 0:
            self._shunned[first] = left - 1
            return None
        self._shunned.pop(first, None)
        self.current = first
        return first

    def answered(self) -> None:
        self._failed.clear()

    def failed(self) -> tuple[str, bool] | None:
        """The one in use did not answer: the next round the list, and whether it is new in
        this run of failures (False: every one failed already); None with nowhere to go."""
        self._failed.add(self.current)
        self._shunned[self.current] = SHUN
        at = self.urls.index(self.current) + 1 if self.current in self.urls else 0
        following = self.urls[at % len(self.urls)]
        if following == self.current:
            return None
        self.current = following
        return following, following not in self._failed
