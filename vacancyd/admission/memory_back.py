"""Waiting for memory a server was asked to give back to show in the GPU's readings.

An unload is a request, not a fact: Ollama answers at once and the driver frees the memory
later (seed 002 measured 63 ms for the answer, 77 ms more for the memory). Both a reclaim
and a hand-off therefore believe only a reading taken after the request that shows the free
memory risen by what they wanted.
"""

from __future__ import annotations

import trio

from vacancyd.state import SharedState

# An unload counts as confirmed once this share of what the server said it held is free.
CONFIRM_SHARE = 0.8
# How often the GPU is re-read while waiting for the memory to come back.
CONFIRM_POLL_S = 0.1


async def wait_for_memory_back(
    state: SharedState,
    gpus: list[str],
    before: dict[str, int | None],
    wanted_bytes: int,
    asked_at: float,
    *,
    deadline_s: float,
    poll_s: float,
) -> float | None:
    """When a reading taken after `asked_at` shows the memory back on any of `gpus`, or None
    past `deadline_s`.

    Samples are asked for at a steady pace (`poll_s`), not on every change: each sample is
    itself a change, so asking on every one would read the GPU back to back on the owner's
    machine. Every reading is looked at as it arrives, though, so the memory is seen back
    as soon as a reading shows it rather than a whole pace later.
    """

    def back() -> bool:
        for name in gpus:
            observation = state.observation(name)
            base = before.get(name)
            if (
                observation is not None
                and observation.taken_at > asked_at
                and observation.free_bytes is not None
                and base is not None
                and observation.free_bytes - base >= wanted_bytes
            ):
                return True
        return False

    with trio.move_on_after(deadline_s):
        next_ask = trio.current_time()
        while True:
            if trio.current_time() >= next_ask:
                state.request_sample()
                next_ask = trio.current_time() + poll_s
            if back():
                # When vacancyd saw it, never earlier than the reading it came from.
                return trio.current_time()
            with trio.move_on_at(next_ask):
                await state.wait_changed()
    return None
