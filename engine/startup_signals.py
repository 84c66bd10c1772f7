"""A scheduler's SIGTERM while an entry point starts, kept for engine/preemption.py.

train.py spends seconds importing (minutes in a multi-node rendezvous) before Preemption installs its handlers;
a SIGTERM then ended the process with status 143, which a requeue script reads as a failure. `record_sigterm`,
called first thing (before torch is imported: this module imports nothing heavy), records it instead; the next
Preemption takes the recorded signal over as a stop request (checkpoint, exit 75) and, when its run ends, gives
SIGTERM its default action back (not this recorder), so that a process waiting in its teardown (a final barrier)
still ends at a plain `kill`. SIGINT is left alone: Ctrl-C at a terminal while the run starts stops at once (not
during the rendezvous, where torch's wait acts on no signal: docs/operations.md).
"""
from __future__ import annotations

import signal

RECEIVED: list[int] = []  # SIGTERMs recorded since `record_sigterm`, until a Preemption takes them over


def _record(signum: int, frame: object) -> None:
    RECEIVED.append(signum)


def record_sigterm() -> None:
    """From now until a Preemption exists, a SIGTERM is recorded (RECEIVED), not fatal."""
    signal.signal(signal.SIGTERM, _record)


def is_recorder(handler: object) -> bool:
    """Whether `handler` is `record_sigterm`'s (Preemption does not put it back)."""
    return handler is _record
