"""Footprints the daemon finds for itself: learned from measured loads, else estimated.

Admission charges a request by the rule in admission/need.py: the model's configured
footprint; else, per resource, what this book gives (`hint`), with `default_need_mib` as
a floor. The book answers, per resource, with what was learned from real loads of the
model (the conservative prior in learned.py), else, on the upstream's primary resource,
an estimate from the model's geometry as the server runs it (served.py, the code path
`vacancyd footprint` uses too: same reads, same credential, same cache type, same
runtime base for the resource's kind).

An estimate is kept while the server's model is the same: at most every RECHECK_AFTER_S
its identity (llama-server's model file and settings, Ollama's digest and settings) is
read again, cheaply, and a change makes a new estimate. One that cannot be made (no file
here, the server did not answer) is tried again after RETRY_AFTER_S. The blocking reads
run in a worker thread under READ_DEADLINE_S, so a slow server only costs the request
that asks that deadline, and never the event loop.

A measured load is what an exclusive, uncredited job (no other borrowed job on the
resource meanwhile) left behind: on a GPU, the fall in its free memory (`measure`, fed
by admission's readings); in host memory, the growth of the upstream's process tree's
RSS from just before the job to just after it (`host_memory`, then `measure`). Host
memory's free figure moves with everything else the owner runs; the server's own
processes do not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import attrs
import httpx
import trio

from vacancyd.config import ResourceConfig, UpstreamConfig
from vacancyd.errors import log_unexpected
from vacancyd.footprint.geometry import GeometryError
from vacancyd.footprint.gguf_reader import GGUFError
from vacancyd.footprint.learned import LearnedFootprints
from vacancyd.footprint.processes import (
    FindServer,
    Member,
    TreeMemory,
    grown_tree,
    machine_pids,
    member,
    members_memory,
    still_running,
    tree_memory,
)
from vacancyd.footprint.served import (
    Identity,
    Unsizable,
    can_size,
    describe,
    read_served,
    served_identity,
    size_served,
    upstream_client,
)
from vacancyd.footprint.sources import SourceError
from vacancyd.model import FootprintHint, ResourceKind
from vacancyd.persist import StateFileProblems

log = logging.getLogger(__name__)

READ_DEADLINE_S = 5.0
RETRY_AFTER_S = 60.0
RECHECK_AFTER_S = 30.0
# How long reading the server's process tree may hold up the job it measures.
TREE_DEADLINE_S = 1.0
# Between readings that search every process for the tree's children (psutil's way), a
# reading after a job looks only at the processes started since the last one
# (`grown_tree`); a pid reused in between is found at the next full search.
FULL_TREE_EVERY_S = 60.0
# A fall in free memory (or a growth of RSS) smaller than this across a job is noise.
MIN_LOAD_MIB = 256

T = TypeVar("T")


@attrs.frozen
class _Estimate:
    total_mib: int | None
    detail: str
    made_at: float
    identity: Identity | None = None
    checked_at: float = 0.0


def hint_from(
    learned: Mapping[str, int], estimated: tuple[str, int, str] | None
) -> FootprintHint | None:
    """The book's answer from what was learned and an estimate (resource, MiB, how), the
    same for admission and the CLI: learned per resource, the estimate where nothing was
    learned."""
    need = dict(learned)
    sources = dict.fromkeys(learned, "learned")
    detail = "measured on earlier loads" if learned else ""
    if estimated is not None and estimated[0] not in need:
        resource, mib, how = estimated
        need[resource], sources[resource] = mib, "estimated"
        detail = f"{how}; other resources {detail}" if learned else how
    if not need:
        return None
    summary = "estimated" if "estimated" in sources.values() else "learned"
    return FootprintHint(need, summary, detail, {r: s for r, s in sources.items() if s != summary})


@attrs.frozen
class _KnownTree:
    """A server's process tree as last read, the machine's pids then (empty where /proc
    could not be listed: the next reading searches in full), and when psutil last
    searched every process for its children."""

    members: frozenset[Member]
    pids: frozenset[int]
    read_in_full_at: float


class FootprintBook:
    def __init__(
        self,
        state_dir: Path,
        problems: StateFileProblems,
        *,
        resources: Iterable[ResourceConfig] = (),
        find_server: FindServer | None = None,
    ) -> None:
        self.learned = LearnedFootprints(state_dir, problems)
        self.learned.load()
        self._kinds = {resource.name: resource.kind for resource in resources}
        self._find_server = find_server
        self._credentials: dict[str, str | None] = {}
        self._estimates: dict[tuple[str, str], _Estimate] = {}
        # Per upstream: the processes that listened for it when last looked for.
        self._roots: dict[str, frozenset[Member]] = {}
        # Per upstream: its whole tree as the last reading that looked for children found it.
        self._trees: dict[str, _KnownTree] = {}
        self._unseen_until: dict[str, float] = {}

    def use_credential(self, upstream: str, credential: str | None) -> None:
        """The credential vacancyd presents to this upstream (its reads need it too)."""
        self._credentials[upstream] = credential

    async def hint(self, upstream: UpstreamConfig, model: str | None) -> FootprintHint | None:
        """The learned, else estimated, footprint of `model` on `upstream`, if any."""
        if model is not None and model in upstream.models:
            return None  # configured: nothing to find
        key_model = model or ""
        learned = self.learned.get(upstream.name, key_model)
        estimated = None
        if upstream.resource not in learned and can_size(upstream):
            found = await self._estimate(upstream, key_model)
            if found.total_mib is not None:
                estimated = (upstream.resource, found.total_mib, found.detail)
        return hint_from(learned, estimated)

    def _kind(self, resource: str) -> ResourceKind:
        # A book told nothing of its resources sizes host memory's larger runtime base.
        return self._kinds.get(resource, ResourceKind.MEMORY)

    async def _estimate(self, upstream: UpstreamConfig, model: str) -> _Estimate:
        key = (upstream.name, model if upstream.adapter.value == "ollama" else "")
        known = self._estimates.get(key)
        now = trio.current_time()
        if known is not None and known.total_mib is None:
            if now - known.made_at < RETRY_AFTER_S:
                return known
        elif known is not None:
            if now - known.checked_at < RECHECK_AFTER_S:
                return known
            identity = await self._off_loop(self._identity_blocking, upstream, model)
            if identity is None or identity == known.identity:
                # Unchanged, or no answer: the estimate stands until the next check.
                self._estimates[key] = attrs.evolve(known, checked_at=now)
                return self._estimates[key]
            log.info("the model served by %s changed: estimating it again", upstream.name)
        found = await self._off_loop(self._estimate_blocking, upstream, model)
        if found is None:
            made = _Estimate(None, "no answer in time", now)
        else:
            made = _Estimate(found[0], found[1], now, found[2], now)
            if found[0] is not None:
                log.info("estimated %s on %s: %s", model or "its model", upstream.name, found[1])
        self._estimates[key] = made
        return made

    async def _off_loop(self, function: Callable[..., T], *args: object) -> T | None:
        """`function(*args)` on a worker thread; None when it misses READ_DEADLINE_S."""
        with trio.move_on_after(READ_DEADLINE_S):
            return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True)
        return None

    def _client(self, upstream: UpstreamConfig) -> httpx.Client:
        return upstream_client(self._credentials.get(upstream.name), READ_DEADLINE_S)

    def _identity_blocking(self, upstream: UpstreamConfig, model: str) -> Identity | None:
        try:
            with self._client(upstream) as client:
                return served_identity(upstream, model, client, self._find_server)
        except (SourceError, OSError, httpx.HTTPError):
            return None
        except Exception as exc:
            log_unexpected(log, f"checking the model of {upstream.name}", exc)
            return None

    def _estimate_blocking(
        self, upstream: UpstreamConfig, model: str
    ) -> tuple[int | None, str, Identity | None]:
        """(total MiB with margin, how it was found, identity), or (None, why not, None)."""
        try:
            with self._client(upstream) as client:
                served = read_served(upstream, model, client, find_server=self._find_server)
            result = size_served(served, self._kind(upstream.resource))
        except (
            Unsizable,
            SourceError,
            GGUFError,
            GeometryError,
            OSError,
            ValueError,
            httpx.HTTPError,
        ) as exc:
            return None, f"cannot estimate: {exc}", None
        except Exception as exc:
            # The server's answers are outside input: a shape nobody planned for means no
            # estimate (the default footprint is charged), never a borrower's 500.
            log_unexpected(log, f"estimating {model or 'its model'} on {upstream.name}", exc)
            return None, f"cannot estimate ({type(exc).__name__})", None
        return result.total_mib, describe(served, result), served.identity

    # -- measured loads ------------------------------------------------------------------

    def measures_host(self, upstream: UpstreamConfig) -> bool:
        """Whether loads on `upstream` are measured in host memory (it needs a memory
        resource, and the server's processes must be findable)."""
        return self._find_server is not None and bool(self._memory_resources(upstream))

    def _memory_resources(self, upstream: UpstreamConfig) -> list[str]:
        names = upstream.resources
        return [name for name in names if self._kinds.get(name) is ResourceKind.MEMORY]

    async def host_memory(
        self, upstream: UpstreamConfig, *, look_for_children: bool = True
    ) -> TreeMemory | None:
        """The RSS of the upstream's process tree now (None: not measured here, not
        found, or not read within TREE_DEADLINE_S).

        With `look_for_children` False (the reading before a job, on its way to the
        upstream), the tree is the one found by the last full reading, without looking
        for processes it started since; a tree never read in full is read in full. A
        child that was missed there is counted whole in the full reading after the job,
        so a load is measured larger, never smaller, than it was."""
        if not self.measures_host(upstream):
            return None
        now = trio.current_time()
        if now < self._unseen_until.get(upstream.name, now):
            return None
        with trio.move_on_after(TREE_DEADLINE_S):
            found = await trio.to_thread.run_sync(
                self._tree_blocking, upstream, look_for_children, abandon_on_cancel=True
            )
            if found is None:
                # Nothing of ours listens there (or not visibly): look again later,
                # not on every request.
                self._unseen_until[upstream.name] = now + RETRY_AFTER_S
            return found
        return None

    def _tree_blocking(
        self, upstream: UpstreamConfig, look_for_children: bool
    ) -> TreeMemory | None:
        # Finding the listener reads every process's sockets; it is done again only when
        # a process that listened is gone.
        assert self._find_server is not None
        roots = self._roots.get(upstream.name)
        if not roots or not all(still_running(root) for root in roots):
            found = (member(pid) for pid in self._find_server(upstream.endpoint))
            roots = frozenset(root for root in found if root is not None)
            self._roots[upstream.name] = roots
            self._trees.pop(upstream.name, None)
        known = self._trees.get(upstream.name)
        if known is not None and not look_for_children:
            present = members_memory(known.members)
            if present is not None:
                return present
        pids = machine_pids()  # before reading: what starts meanwhile is new next time
        now = time.monotonic()
        fresh = known is not None and now - known.read_in_full_at < FULL_TREE_EVERY_S
        if known is not None and fresh and known.pids and pids is not None:
            grown = grown_tree(known.members, known.pids, pids)
            if grown is not None:
                self._trees[upstream.name] = _KnownTree(grown.members, pids, known.read_in_full_at)
                return grown
        tree = tree_memory(root.pid for root in roots)
        if tree is not None:
            self._trees[upstream.name] = _KnownTree(tree.members, pids or frozenset(), now)
        return tree

    def measure_host(
        self,
        upstream: UpstreamConfig,
        model: str | None,
        before_mib: int,
        after: TreeMemory | None,
    ) -> None:
        """An exclusive job ran between a reading of `before_mib` and `after`: what the
        tree grew by is the load's footprint on the upstream's memory resources."""
        if after is None:
            return
        grew = after.rss_mib - before_mib
        for resource in self._memory_resources(upstream):
            self.measure(upstream.name, model, resource, grew)

    def measure(self, upstream: str, model: str | None, resource: str, fell_mib: int) -> None:
        """One exclusive load took `fell_mib` of `resource`: learn it (and save, off-loop
        by the caller's choice; saving is small and atomic)."""
        if fell_mib < MIN_LOAD_MIB:
            return
        prior = self.learned.record(upstream, model or "", resource, fell_mib)
        log.info(
            "measured a load of %s on %s: %d MiB of %s (prior now %d MiB)",
            model or "its model",
            upstream,
            fell_mib,
            resource,
            prior,
        )
        try:
            self.learned.save()
        except OSError as exc:
            log.warning("cannot save learned footprints to %s: %s", self.learned.path, exc)
