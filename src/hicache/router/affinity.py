"""Where each conversation was last sent: its home worker, kept after its pages are gone.

A conversation's next turn extends its last prompt, so its pages begin with the last
prompt's full pages. The router records, for each request it routes, the chained hash
of its deepest full page and the worker it chose; a later request's home is the worker
recorded at the deepest of its own pages that has an entry (a shared system prompt's
page is never the deepest page of a real conversation's turn, so conversations that
share an opening keep their own homes).

Why the router remembers this when the tier index already knows which worker holds
which page: once a conversation's pages have left every worker's device and host (a
working set larger than the cluster's L1 + L2, the shared L3 holding it for all), the
index sees nothing that tells the workers apart and the choice goes by load alone, so
turns wander between workers. A worker's host tier keeps a loop-resistant core set of
the conversations it sees return (``radix``'s core set); a worker whose stream is a
stable set of conversations keeps more of them, and one whose stream is a random half
of all conversations keeps less. So the scoring policies send a request home unless
that costs it more than a request of its own size would (the rule is in ``policy.py``'s
docstring): stickiness that never queues a turn behind more than one extra prompt.

Opt-in (``--conversation-affinity on``): measured against the same router without it on
the router sweep (docs/benchmarks.md, 2026-11-29), it was level where the working set is
twice the cluster's L1 + L2 and lost where it is four times (p99 TTFT twice as long, fewer
L3 hits): there no worker keeps a conversation anyway, and waiting at home only queues.

Bounded: at most ``max_entries`` pages (the least recently recorded or used go first).
Lives on the router's event loop: no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

DEFAULT_MAX_ENTRIES: Final = 65_536


class ConversationHomes:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.max_entries = max_entries
        self._homes: OrderedDict[int, str] = OrderedDict()  # page hash -> worker url

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, page_hashes: Sequence[int]) -> str | None:
        """The worker recorded at the deepest of ``page_hashes`` that has an entry."""
        homes = self._homes
        for page_hash in reversed(page_hashes):
            worker = homes.get(page_hash)
            if worker is not None:
                homes.move_to_end(page_hash)
                return worker
        return None

    def record(self, page_hashes: Sequence[int], worker: str) -> None:
        """A request of these pages was sent to ``worker``: its deepest page's home."""
        if not page_hashes:
            return
        homes = self._homes
        homes[page_hashes[-1]] = worker
        homes.move_to_end(page_hashes[-1])
        while len(homes) > self.max_entries:
            homes.popitem(last=False)
