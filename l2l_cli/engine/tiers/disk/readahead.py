"""The disk tier's read-ahead plan: which layers the relay and the updates will use next.

L2L's schedule uses layers one at a time in a known order (forward 0..N+1, backward N+1..0, the updates),
and a step repeats the last one's accesses. So the plan is the last training step's trace of pins, followed
by each thread (compute, EPS) as it pins (ZeRO-Infinity prefetches the same way); where a thread strays from
it (an evaluation, say) the plan falls back to the direction each stream walks the layers in. The reader
thread (:mod:`.reader`) reads what the plan names, most urgent first.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

MOMENTS = frozenset("mv")  # (layout.MOMENTS: what an update reads beyond the weights)
Pin = tuple[int, frozenset[str], bool, bool]  # (layer, parts, fresh, on the compute thread)


@dataclass
class Stream:
    """Who walks the layers in order (the relay; the updates), where it is and which way it goes."""

    last: int
    step: int
    parts: frozenset[str]
    reflect: bool  # the relay turns at the ends (forward -> backward -> next step's forward)
    clock: int


class ReadAhead:
    """The plan of the next layers to read, from the pins so far (the tier's lock guards it)."""

    def __init__(self, n_layers: int, n_slots: int, main: int):
        self.n_layers, self.n_slots, self._main = n_layers, n_slots, main
        self.streams: dict[str, Stream] = {}
        # this step's pins so far, the last step's, and per thread (compute, EPS) where in that trace its
        # last pin was, or None when it strayed from it
        self._trace: list[Pin] = []
        self._plan: list[Pin] = []
        self._cursor: dict[bool, int | None] = {True: -1, False: -1}
        self._clock = 0
        self.updates: list[
            int
        ] = []  # of the last ``predicted``: the layers whose moments come next, in order

    def follow(self, i: int, need: frozenset[str], fresh: bool) -> None:
        """Record this pin in the step's trace and move this thread's place in the last step's trace."""
        main = threading.get_ident() == self._main
        entry = (i, need, fresh, main)
        if not (fresh and "w" in need):  # building or loading the state is not part of a step
            self._trace.append(entry)
        start = self._cursor[main]
        if start is None:
            start = -1
        self._cursor[main] = next(
            (k for k in range(start + 1, len(self._plan)) if self._plan[k] == entry), None
        )

    def note(self, name: str, i: int, parts: frozenset[str]) -> None:
        """Stream ``name`` (the relay; the updates) is at layer i now."""
        prev = self.streams.get(name)
        step = prev.step if prev else 1
        if prev is not None and i != prev.last:
            step = 1 if i > prev.last else -1
        self._clock += 1
        self.streams[name] = Stream(i, step, parts, name == "relay", self._clock)

    def end_step(self, training: bool) -> None:
        """A step is over: its trace of pins becomes the next step's plan (``training=False``: an
        evaluation's, which is no plan)."""
        self.streams.pop("update", None)
        if training and self._trace:
            self._plan = self._trace
        self._trace = []
        self._cursor = {True: -1, False: -1}

    def _walk(self, st: Stream) -> list[int]:
        """The layers ``st`` uses next. The relay's last layer is on the device already, so its walk starts
        past it, and turns at the ends as L2L's step does: after the head, the backward goes down from the
        layer below it (the head runs forward and backward at once); after the embeddings' backward, the
        next step's forward starts with the embeddings again (they were updated). An update's walk starts
        at the layer being updated (it is held)."""
        n, j, d = self.n_layers, st.last, st.step
        seq = [] if st.reflect else [j]
        while len(seq) < self.n_slots:
            nj = j + d
            if not 0 <= nj < n:
                if not st.reflect or n < 2:
                    break
                d = -d
                nj = j + d if d < 0 else j
            j = nj
            seq.append(j)
        return seq

    def predicted(self) -> list[tuple[int, frozenset[str]]]:
        """The next layers to be used and the parts to read for them (none: a slot for a gradient), most
        urgent first, as many as the cache holds. From the last step's trace while the threads follow it
        (then the cache keeps exactly the layers used soonest, Belady's choice); else by the direction
        each stream walks the layers in."""
        k = self.n_slots
        want: dict[int, set[str]] = {}
        updates: list[
            int
        ] = []  # the layers whose moments are wanted, in the order of the pins that want them
        if self._plan and self._cursor[True] is not None:
            plan = self._plan
            cur = {m: -1 if c is None else c for m, c in self._cursor.items()}
            first = min(cur.values()) + 1
            # the entries after each thread's place, then on into the next step (the trace again)
            this_step = ((True, n) for n in range(first, len(plan)))
            for now, n in itertools.chain(this_step, ((False, n) for n in range(len(plan)))):
                j, parts, fresh, main = plan[n]
                if now and n <= cur[main]:
                    continue
                if j not in want and len(want) == k:
                    break
                want.setdefault(j, set()).update(() if fresh else parts)
                if not fresh and parts & MOMENTS and j not in updates:
                    updates.append(j)
        else:
            for st in sorted(self.streams.values(), key=lambda s: -s.clock):
                for j in self._walk(st):
                    want.setdefault(j, set()).update(st.parts)
                    if st.parts & MOMENTS and j not in updates:
                        updates.append(j)
        self.updates = updates
        return [(j, frozenset(p)) for j, p in list(want.items())[:k]]
