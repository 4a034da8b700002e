"""The Mooncake tier: rows kept in a Mooncake Store cluster (a master, and clients that pool memory).

Beyond a handful of machines, spill goes to an existing distributed KV store rather than a
mesh of ``kvtier peer`` processes. Mooncake Store's master tracks objects, leases, replicas
and eviction; every client mounts a *segment* of its memory into the shared pool and moves
bytes with Mooncake's transfer engine (TCP, or RDMA). This tier is such a client.

One row is **one object**: the 40-byte ``RowHeader`` (layout id, length, xxh3 checksum)
followed by the row, assembled by the store from two buffers (``batch_put_from_multi_buffers``
/ ``batch_get_into_multi_buffers``): the header from a small registered staging area, the
row straight from (into) the host tier, which is registered once at ``open``. So rows move
zero-copy, the header travels with its row atomically (an object is evicted whole), and a
get is verified before it counts: the header must match this tier's layout and the row's
length, and the row's checksum, computed right after it landed (GIL released), must match
the header. A corrupt object is a miss, counted and removed from the store. Measured: the
header costs nothing next to the store's own single-buffer calls.

Keys: ``kvtier/<namespace hex>/<block key hex>``. The store takes any non-empty string, but
hex keeps keys printable for the master's tools (``remove_by_regex("^kvtier/<ns>/")`` clears
one namespace). The namespace digest includes the tenant salt, so tenants never see each
other's rows, not even as a hit.

What the store answers (Mooncake 0.3.13, per key): ``0`` stored (also when the key exists
already: the first object is kept; keys name their content, so that is a hit for later);
``-200`` no space (tried again while the master evicts objects whose lease expired, which
become misses; still refused: dropped and counted); ``-704`` not found (never put, evicted,
or lost with a restarted master: a miss); ``-600`` / ``-800`` the buffers do not add up to
the object (a row of another length: a miss); ``-800`` on a put: the transfer to the
storage host failed (unreachable: a loopback ``local_hostname`` across hosts did that);
``-900`` / ``-901`` the master is unreachable / did not answer.

Failures. Every call runs on the tier's own threads (the store's calls block), with a
deadline. A master that is killed makes calls fail at once (``-900``) or within ~4 s (a
put reconnects); a master that hangs holds a call for the store's RPC timeout (30 s). A
call that reports the master lost marks the store **down**: until a backoff expires
(``backoff_s`` doubling to ``max_backoff_s``) every call answers at once without touching
the store (puts dropped, gets and contains misses). After the backoff the tier knocks on
the master's port (a TCP connect on the event loop); if it answers, the next call goes
through: the client reconnects by itself, and a restarted master has the client's segment
re-mounted within about a second. A call still queued on the tier's busy threads at its
deadline is cancelled, with no verdict on anything (that is congestion, not an outage).

A call that started and overran its deadline is not, by itself, a verdict on the master:
one storage host that stops, loses its link or slows holds the store's calls for its
objects (issue #20: 42 s, and the master was then reported gone). So the tier asks the
master one cheap question on a thread of its own (where the late call's objects live,
``probe_timeout_s``): no answer, the master is down as above; an answer names the storage
hosts at fault (logged, ``fault_hosts``, ``host_faults``), which rest (``SuspectHosts``,
``tiers.mooncake.faults``): gets skip objects held only there (misses, ``skipped_host``)
instead of meeting them again. Mooncake's own TCP timeouts are set from the deadline
(``bound_store_timeouts``), so the late call itself ends within seconds, not a minute.

What a caller waits, whatever one storage host does: a ``put`` or ``contains`` returns at
its deadline even if the store's call goes on (a late put is harmless: its row is
checksummed, and its header slot stays reserved until the call ends). A ``get`` writes into
host rows, and nothing can stop the store's call once it started: the tier waits
``late_get_grace_s`` (``min(1 s, deadline_s)``) more for the store's timeouts to end it,
then raises ``RowsAbandoned``: the rows are misses and the tier engine reports the
operation abandoned, so the manager keeps those host slots out of use until the store's
call has ended (``RowsAbandoned.ended``: the store's own timeouts end it in seconds). So every call ends by
``deadline_s`` (a get: ``deadline_s + late_get_grace_s``) plus the event loop's latency.

Drops. A row a put does not store is counted (``dropped``; by reason: ``full``,
``unreachable``, ``timeouts``, ``skipped_down``) and logged at most every 10 s with the
counts (``DropLog``); ``Offloader.stats()["tiers"]["mooncake"]`` shows them. Rows refused
for want of space are put again while the master evicts (``_retry_no_space``), so a full
store stores fewer rows, not none of a batch.

The store's ``setup`` and ``close`` hold the GIL while they retry an absent master (90 s
and ~11 s measured; up to the 30 s RPC timeout for a hung one), which would stop every
thread of the process. So ``open`` knocks on the master's port first (no master: a
``TierError`` at once), and ``close`` leaves a client whose master is down as it is.

No credentials. Mooncake Store authenticates nobody: any client that reaches the master
reads, overwrites and removes any object (``remove_by_regex`` included), kvtier's rows of
every namespace among them; the namespace keeps tenants apart only from each other's
*lookups*. And the transfer engine in this process listens on every interface, serving
reads and writes of the memory registered with it (the segment, and the whole host tier)
to whoever connects (``tiers.mooncake.listen``). So the tier ties those listeners to one interface after
``setup`` (``listen_interface``: by default the one holding ``local_hostname``, i.e. the
one on the route to the master) and a cluster must run on a private network: the tier's
integrity checks (header, checksum) catch corrupted rows, not a hostile client.

Threads: the coroutines run on the tier engine's event loop; the store's calls run on
``threads`` daemon threads of this tier (daemon, so a call stuck on a hung master never
holds up the process's exit). ``may_contain`` and ``stats`` only read a dict and ints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from tiers.base import LowerTier, Row, RowsAbandoned, TierError, TierStats
from tiers.fast_checksum import checksum_at
from tiers.mooncake import hostname as mooncake_hostname
from tiers.mooncake import listen as mooncake_listen
from tiers.mooncake.faults import DropLog, SuspectHosts, bound_store_timeouts, replica_hosts
from tiers.row_format import HEADER_BYTES, RowHeader, served_layouts, verify
from tiers.settings import MooncakeSettings
from tiers.shared import Backoff, HostRegion, KnownKeys

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install 'kvtier[mooncake]' (its binaries also need libibverbs: apt-get install -y libibverbs1)"
)

# Mooncake's ErrorCode values (mooncake-store/include/types.h); Python receives plain ints.
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_MASTER_LOST = frozenset({RPC_FAIL, RPC_TIMEOUT})
_WRONG_SIZE = frozenset({INVALID_PARAMS, TRANSFER_FAIL})
# Outcomes of this tier's own, beside the store's codes (which are >= -2000).
_VERIFIED = -1_000_001  # a get whose row passed its header and checksum
_CORRUPT = -1_000_002  # a get whose row failed them
_SKIPPED = -1_000_003  # a row the store was not asked about (down, or no header slot)
_FOREIGN = -1_000_004  # a get whose row is sound but in a layout this reader cannot use
_LATE = -1_000_005  # a call that missed its deadline (or was still queued then)
_SKIPPED_HOST = -1_000_006  # a get of an object held only on a storage host that rests
_NOT_ASKED = frozenset({_SKIPPED, _LATE, _SKIPPED_HOST})
_STORED = frozenset({0, OBJECT_ALREADY_EXISTS})
# Why a put's row was not stored, as DropLog reports it.
_NO_SPACE = "no space in the store (-200)"
_UNREACHABLE = "transfer failed (-800: a storage host unreachable)"
_DROP_REASONS = {
    NO_AVAILABLE_HANDLE: _NO_SPACE,
    TRANSFER_FAIL: _UNREACHABLE,
    RPC_FAIL: "master unreachable",
    RPC_TIMEOUT: "master unreachable",
    _SKIPPED: "not sent (master down, or too many rows in flight)",
    _LATE: "past the deadline",
}


def _drop_reason(code: int) -> str:
    return _DROP_REASONS.get(code, f"store error {code}")


NO_SPACE_BUDGET = 0.5  # of the deadline, for putting again rows that found no room
NO_SPACE_FIRST_WAIT_S = 0.002
NO_SPACE_MAX_WAIT_S = 0.032
NO_SPACE_MAX_STALLS = 6  # attempts in a row that store nothing: the store is not making room
PROBE_NAMES = 64  # objects of a late call whose whereabouts the probe asks

MIN_SEGMENT_BYTES = 16 << 20
"""The store refuses to mount a smaller segment (``setup`` answers -600)."""
_HEADER_SLOT = 64  # bytes per staged header: 40 used, 64-byte aligned
_CLOSE_S = 2.0


@dataclass
class MooncakeStats(TierStats):
    """The Mooncake tier's counters and, in a ``stats()`` snapshot, its levels."""

    stored: int = 0
    dropped: int = 0  # rows a put did not store, whatever the reason (logged by DropLog)
    full: int = 0  # of them: the store had no room (-200), even after retries
    unreachable: int = 0  # of them: the transfer to the storage host failed (-800)
    stored_on_retry: int = 0  # rows stored by a retry after the store had no room for them
    hits: int = 0
    misses: int = 0
    absent: int = 0  # gets of objects the store does not hold (-704)
    mismatched: int = 0  # objects of another length or layout: misses, kept
    corrupt: int = 0
    errors: int = 0  # other codes of the store
    timeouts: int = 0  # calls past their deadline (puts: their rows dropped; gets: missed)
    abandoned: int = 0  # rows of gets given up on while the store's call still ran
    host_faults: int = 0  # late calls the master answered for: a storage host at fault
    skipped_host: int = 0  # rows of gets not asked for: held only on a resting storage host
    master_lost: int = 0
    recoveries: int = 0
    skipped_down: int = 0  # rows not asked about while the store was down
    master_up: int = 1
    known_keys: int = 0
    capacity_bytes: int = 0  # this process's share of the store's pool (its segment)


def store_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``, or ``TierError`` saying how to install it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # the package is missing, or its .so cannot load libibverbs
        raise TierError(f"the mooncake tier is unavailable ({exc}): {INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def object_key(namespace: bytes, key: bytes) -> str:
    """The store's key for ``key`` in ``namespace`` (see the module docstring)."""
    return f"kvtier/{namespace.hex()}/{key.hex()}"


class _Workers:
    """Daemon threads that run blocking store calls; ``submit`` returns a concurrent future.

    A future that has not started can still be cancelled (``Future.cancel``): the worker
    skips it. ``ThreadPoolExecutor`` is not used because its threads are joined at exit.
    """

    def __init__(self, count: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._unfinished: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._unfinished.add(future)
        future.add_done_callback(self._finished)
        self._queue.put((future, fn, args))
        return future

    def unfinished(self) -> list[concurrent.futures.Future]:
        """Calls queued or running now (a late call past its deadline among them)."""
        with self._lock:
            return list(self._unfinished)

    def _finished(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._unfinished.discard(future)

    def close(self) -> None:
        """Let every thread end once the work queued before this is done (no join)."""
        for _ in self._threads:
            self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


class _HeaderSlots:
    """A registered staging area for row headers, handed out in slots of 64 bytes.

    A call takes a slot per row and gives them back when the store's call has ended (not
    when the coroutine returned: a call past its deadline may still read or write them).
    """

    def __init__(self, count: int) -> None:
        self.array = np.zeros(count * _HEADER_SLOT, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        self._free = list(range(count - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int] | None:
        with self._lock:
            if len(self._free) < n:
                return None
            taken, self._free[-n:] = self._free[-n:], []
            return taken

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def view(self, slot: int) -> memoryview:
        return memoryview(self.array)[slot * _HEADER_SLOT : slot * _HEADER_SLOT + HEADER_BYTES]


class MooncakeTier(LowerTier):
    """A Mooncake Store client holding rows of one namespace and layout; see the module docstring.

    ``settings`` (``MooncakeSettings``, the TOML's keys): ``master``: the master's
    ``host:port``. ``metadata_server``: where transfer engines find each other:
    ``"P2PHANDSHAKE"`` (no server: clients exchange metadata directly) or an
    ``http://host:port/metadata`` / etcd address. ``capacity_bytes``: the segment, the memory
    this process mounts into the store's pool (at least 16 MiB; 0: a client that only uses
    others' memory). ``local_buffer_bytes``: the client's own transfer buffer (rows bypass it; at least 16 MiB
    is what the store allocates by default). ``protocol``: ``"tcp"`` or ``"rdma"`` (with
    ``device_name``). ``local_hostname``: the address other clients reach this one's
    segment at (``""``: this machine's address on the route to the master; a loopback one
    is refused while the master is elsewhere: ``tiers.mooncake.hostname``).
    ``listen_interface``: the interface (a name, or an address it holds) that this
    client's listeners accept connections on; ``""``: the one holding ``local_hostname``;
    ``"*"``: every interface, Mooncake's own behaviour (see the module docstring: reaching
    them is reaching the host tier's memory). ``replicas``: copies of each object.
    ``deadline_s``: the most a call waits (see the module docstring for gets). Beside them,
    knobs no configuration sets: ``open_timeout_s``, ``backoff_s``, ``max_backoff_s``; ``threads``:
    concurrent store calls. ``max_rows_in_flight``: header slots, i.e. rows in calls at once
    (beyond it rows are dropped or missed).
    """

    kind = "mooncake"
    index_is_partial = True  # other engines' rows are found by ``contains``

    def __init__(
        self,
        settings: MooncakeSettings,
        namespace: bytes,
        layout_id: bytes,
        *,
        open_timeout_s: float = 15.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        late_get_grace_s: float | None = None,
        probe_timeout_s: float | None = None,
        threads: int = 2,
        max_rows_in_flight: int = 16384,
        max_tracked_keys: int = 1 << 20,
        readable_layouts: Collection[bytes] = (),
    ) -> None:
        self.settings = settings
        segment_bytes, replicas, deadline_s = settings.capacity_bytes, settings.replicas, settings.deadline_s
        listen_interface = settings.listen_interface
        layouts = served_layouts(layout_id, readable_layouts)
        if segment_bytes and segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes = {segment_bytes}: the store needs 0 or at least 16 MiB")
        if not deadline_s > 0 or threads < 1 or replicas < 1 or max_rows_in_flight < 1:
            raise ValueError("deadline_s, threads, replicas and max_rows_in_flight must be positive")
        problem = mooncake_listen.check_listen_interface(listen_interface)
        if problem:
            raise ValueError(f"listen_interface = {listen_interface!r}: {problem}")
        self._store_class = store_class()  # unavailable: a clear error now, not at open
        self.master = settings.master
        self.namespace = bytes(namespace)
        self.layout_id = bytes(layout_id)
        self.layouts = layouts  # what get may serve
        self.metadata_server = settings.metadata_server
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = settings.local_buffer_bytes
        self.protocol = settings.protocol
        self.device_name = settings.device_name
        self.local_hostname = settings.local_hostname  # at open: the address others are told
        self.listen_interface = listen_interface
        self.listening_on = ""  # the interface the listeners were tied to, at open
        self.replicas = replicas
        self.deadline_s = deadline_s
        self.open_timeout_s = open_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._backoff = Backoff(backoff_s, max_backoff_s)
        # A late get waits this long for the store's own timeouts to end it (then: abandoned).
        self.late_get_grace_s = min(1.0, deadline_s) if late_get_grace_s is None else late_get_grace_s
        self.probe_timeout_s = min(1.0, deadline_s) if probe_timeout_s is None else probe_timeout_s
        # A storage host a call overran on rests (gets skip it) 5 s or four deadlines, doubling
        # per repeat up to 30 s: a stopped or cut-off host stays so for longer than that, and
        # each get that meets it again costs a deadline and its rows (abandoned).
        self._suspects = SuspectHosts(Backoff(max(5.0, 4 * deadline_s), max(30.0, max_backoff_s)))
        self.fault_hosts: list[str] = []  # the storage hosts the latest late call was blamed on
        self._drops = DropLog()
        self._judging = False
        self._prober: _Workers | None = None  # one thread: a probe never queues behind stuck calls
        self.threads = threads
        self.max_rows_in_flight = max_rows_in_flight
        self.max_tracked_keys = max_tracked_keys
        self._store: Any = None
        self._put_config: Any = None
        self._workers: _Workers | None = None
        self._headers: _HeaderSlots | None = None
        self._host = HostRegion(0, 0)
        self._failures = 0  # consecutive outages; 0: the store is up
        self._retry_at = 0.0  # while down: when to knock on the master's port again
        self._knocking = False
        self._known = KnownKeys(max_tracked_keys)  # keys this client stored, oldest forgotten first
        self._stats = MooncakeStats()

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self, host_buffer: memoryview | None = None) -> None:
        """Join the store (``setup``) and register the host tier and the header staging area.

        A master that does not answer within ``open_timeout_s``, or a ``setup`` the store
        refuses, is a ``TierError`` naming the master.
        """
        if self._store is not None:
            raise TierError("the mooncake tier is already open")
        self._host = HostRegion.of(host_buffer, "mooncake")
        self._headers = _HeaderSlots(self.max_rows_in_flight)
        self._workers = _Workers(self.threads, "kvtier-mooncake")
        await self._choose_hostname()
        bound_store_timeouts(self.deadline_s)
        # The store's ``setup`` holds the GIL while it retries an absent master (90 s): every
        # thread of the process would stop. Knock on the master's port first.
        if not await self._master_reachable(self.open_timeout_s):
            self._workers.close()
            raise TierError(f"mooncake tier: no master listens at {self.master}")
        store = self._store_class()
        future = self._workers.submit(self._setup_blocking, store)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.open_timeout_s)
        except TimeoutError:
            self._workers.close()
            raise TierError(
                f"mooncake tier: the master at {self.master} did not answer in {self.open_timeout_s:.0f} s"
            ) from None
        except TierError:
            self._workers.close()
            raise
        self._store = store
        self._prober = _Workers(1, "kvtier-mooncake-probe")
        log.info(
            "mooncake tier: joined master %s as %s (metadata %s, %s), segment %.0f MiB",
            self.master,
            self.local_hostname,
            self.metadata_server,
            self.protocol,
            self.segment_bytes / (1 << 20),
        )

    async def _choose_hostname(self) -> None:
        """Settle ``local_hostname`` (``tiers.mooncake.hostname``) before anything joins: a
        loopback address with a master elsewhere is a ``TierError`` naming the key. On a
        store thread, as the master's name may need a DNS lookup."""
        assert self._workers is not None
        choose = partial(mooncake_hostname.advertised_hostname, self.settings.local_hostname, self.master)
        try:
            chosen = asyncio.wrap_future(self._workers.submit(choose))
            self.local_hostname = await asyncio.wait_for(chosen, self.open_timeout_s)
        except (ValueError, TimeoutError) as exc:
            self._workers.close()
            why = exc if isinstance(exc, ValueError) else f"resolving the master {self.master} timed out"
            raise TierError(f"mooncake tier: {why}") from exc

    def _setup_blocking(self, store: Any) -> None:
        from mooncake.store import ReplicateConfig

        interface = ""
        if self.listen_interface != mooncake_listen.ANY_INTERFACE:
            try:  # before setup: a wrong interface must not leave a client joined
                interface = mooncake_listen.interface_for(self.listen_interface or self.local_hostname)
            except OSError as exc:
                raise TierError(
                    f"mooncake tier: no interface to keep its listeners on "
                    f"({'listen_interface' if self.listen_interface else 'local_hostname'}: {exc}); "
                    "set listen_interface to one, or to '*' for every interface"
                ) from exc
        before = mooncake_listen.listening_sockets()
        rc = store.setup(
            self.local_hostname,
            self.metadata_server,
            self.segment_bytes,
            self.local_buffer_bytes,
            self.protocol,
            self.device_name,
            str(self.master),
        )
        if rc != 0:
            raise TierError(
                f"mooncake tier: setup with master {self.master}, metadata {self.metadata_server!r}, "
                f"protocol {self.protocol!r} failed ({rc}); is the master running?"
            )
        self._restrict_listeners(store, before, interface)
        assert self._headers is not None
        for addr, size in (
            (self._host.addr, self._host.length),
            (self._headers.addr, self._headers.array.nbytes),
        ):
            rc = store.register_buffer(addr, size)
            if rc != 0:
                store.close()
                raise TierError(f"mooncake tier: registering {size} bytes of memory failed ({rc})")
        self._put_config = ReplicateConfig()
        self._put_config.replica_num = self.replicas

    def _restrict_listeners(self, store: Any, before: dict[int, int], interface: str) -> None:
        """Tie the listeners ``setup`` opened to ``interface`` (``"": leave them on every one)."""
        fds = mooncake_listen.new_listeners(before)
        if not interface:
            log.warning(
                "mooncake tier: listen_interface = '*': this client's listeners accept connections "
                "on every interface, and whoever connects reads and writes the host tier's memory"
            )
            return
        try:
            ports = mooncake_listen.bind_to_interface(fds, interface)
        except OSError as exc:
            store.close()
            raise TierError(
                f"mooncake tier: cannot keep its listeners on interface {interface!r}: {exc}; "
                "listen_interface = '*' leaves them on every interface (firewall them then)"
            ) from exc
        if not ports:
            log.warning("mooncake tier: setup opened no listener to keep on %s", interface)
        self.listening_on = interface
        log.info("mooncake tier: listeners on ports %s accept connections on %s only", ports, interface)

    async def close(self) -> None:
        """Leave the store, waiting at most ``_CLOSE_S`` (it then finishes on its thread).

        With its master gone, the store's ``close`` (and its destructor) retries the master
        for ~11 s *holding the GIL* (up to its 30 s RPC timeout if the master hangs), which
        would stop every thread of the process. So a client whose master is down, or does not
        take a connection now, is left as it is, never torn down (a leak, in a failure). So
        is one with a call still running (a late get or put): tearing the store down under it
        crashed the process (SIGSEGV)."""
        store, self._store = self._store, None
        workers, self._workers = self._workers, None
        prober, self._prober = self._prober, None
        if workers is None:
            return
        late = workers.unfinished() + (prober.unfinished() if prober is not None else [])
        if late:
            _, late = await asyncio.wait({asyncio.wrap_future(f) for f in late}, timeout=_CLOSE_S)
        if prober is not None:
            prober.close()
        if store is not None and late:
            log.warning(
                "mooncake tier: %d store calls still run after %.0f s; its client is left open, "
                "not torn down",
                len(late),
                _CLOSE_S,
            )
            _keep_forever(store)
        elif store is not None and (self._failures or not await self._master_reachable(_CLOSE_S)):
            log.warning("mooncake tier: master %s gone; its client is left open, not torn down", self.master)
            _keep_forever(store)
        elif store is not None:
            future = workers.submit(store.close)
            del store  # the last reference goes with the worker's call: teardown runs there
            done, _ = await asyncio.wait({asyncio.wrap_future(future)}, timeout=_CLOSE_S)
            if not done:
                log.warning("mooncake tier: the store's close did not finish in %.0f s", _CLOSE_S)
        workers.close()

    # -- the LowerTier verbs ----------------------------------------------------------------

    def may_contain(self, key: bytes) -> bool:
        return key in self._known

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys or not await self._usable(len(keys)):
            return [False] * len(keys)
        names = [object_key(self.namespace, bytes(k)) for k in keys]
        future = self._pool().submit(self._store.batch_is_exist, names)
        codes = await self._call(future, must_finish=False, timeout=self.deadline_s, names=names, lookup=True)
        if codes is None:
            return [False] * len(keys)
        self._note_master(codes)
        return [code == 1 for code in codes]

    async def put(self, rows: Sequence[Row]) -> list[bool]:
        """Store rows; a row that cannot be placed is a counted, logged drop (``DropLog``).

        Rows the store has no room for (``-200``) are tried again while the master evicts
        (``_retry_no_space``), so a full store stores fewer rows, not none of a batch."""
        started = time.monotonic()
        codes = await self._move(rows, self._put_blocking, must_finish=False, timeout=self.deadline_s)
        self._note_master(codes)
        codes = await self._retry_no_space(rows, codes, started)
        stored = [code in _STORED for code in codes]
        reasons: Counter[str] = Counter(_drop_reason(code) for code in codes if code not in _STORED)
        errors = [c for c in codes if c not in _STORED and _drop_reason(c).startswith("store error")]
        self._stats.full += reasons[_NO_SPACE]
        self._stats.unreachable += reasons[_UNREACHABLE]
        self._stats.errors += len(errors)
        self._stats.stored += sum(stored)
        self._stats.dropped += len(rows) - sum(stored)
        self._drops.add(reasons, len(rows))
        self._known.add_stored(rows, stored)
        return stored

    async def _retry_no_space(self, rows: Sequence[Row], codes: list[int], started: float) -> list[int]:
        """Put again the rows the store had no room for (``-200``), while it makes room.

        Mooncake allocates per object, and on a put that finds no room its master evicts a
        share of the objects whose lease expired (5% by default) in the background, a few
        ms later: measured with a 16 MiB pool and 64-row batches of 256 KiB, each batch
        stored 3 rows; trying the rest again every few ms stored all 64 in 0.25-0.35 s. The
        retries wait on the event loop (a store thread is held only by each attempt), back
        off while nothing gets in, and stop at ``NO_SPACE_BUDGET`` of the deadline."""
        budget_end = started + self.deadline_s * NO_SPACE_BUDGET
        delay, stalls = NO_SPACE_FIRST_WAIT_S, 0
        while stalls < NO_SPACE_MAX_STALLS:
            waiting = [i for i, code in enumerate(codes) if code == NO_AVAILABLE_HANDLE]
            if not waiting or time.monotonic() + delay >= budget_end:
                break
            await asyncio.sleep(delay)
            left = started + self.deadline_s - time.monotonic()
            again = await self._move(
                [rows[i] for i in waiting], self._put_blocking, must_finish=False, timeout=left
            )
            placed = 0
            for i, code in zip(waiting, again, strict=True):
                codes[i] = code
                placed += code in _STORED
            self._stats.stored_on_retry += placed
            if placed:
                delay, stalls = NO_SPACE_FIRST_WAIT_S, 0
            else:
                delay, stalls = min(2 * delay, NO_SPACE_MAX_WAIT_S), stalls + 1
            if any(code in _MASTER_LOST or code == _LATE for code in again):
                break
        return codes

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        """Get header + row into the buffers; ``layouts``, when given, receives each hit's
        layout id (its own, or one of ``readable_layouts``). Objects held only on a storage
        host that a call overran on lately (``SuspectHosts``) are misses, not asked for.
        ``RowsAbandoned`` if the store's call still runs ``late_get_grace_s`` past the
        deadline (see the module docstring)."""
        served: list[bytes | None] = [None] * len(rows)
        avoid = self._suspects.active()
        blocking = partial(self._get_blocking, served=served, avoid=avoid)
        codes = await self._move(rows, blocking, must_finish=True, timeout=self.deadline_s)
        self._note_master(codes)
        loaded = []
        for i, ((key, _), code) in enumerate(zip(rows, codes, strict=True)):
            loaded.append(code == _VERIFIED)
            if layouts is not None:
                layouts[i] = served[i] if code == _VERIFIED else None
            if code == _VERIFIED:
                continue
            if code == _CORRUPT:
                self._stats.corrupt += 1
            elif code == OBJECT_NOT_FOUND:  # never put here, evicted, or lost with the master
                self._stats.absent += 1
                self._known.discard(bytes(key))
            elif code == _SKIPPED_HOST:
                self._stats.skipped_host += 1
            elif code in _WRONG_SIZE or code >= 0 or code == _FOREIGN:
                self._stats.mismatched += 1
            elif code not in _MASTER_LOST and code not in _NOT_ASKED:
                self._stats.errors += 1
                log.warning("mooncake tier: a get failed (%d)", code)
        hits = sum(loaded)
        self._stats.hits += hits
        self._stats.misses += len(rows) - hits
        return loaded

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove objects (absent ones are ignored). Objects under a lease (another client may
        be reading them) stay until the master evicts them."""
        for key in keys:
            self._known.discard(bytes(key))
        if not keys or not await self._usable(0):
            return
        names = [object_key(self.namespace, bytes(k)) for k in keys]
        future = self._pool().submit(self._store.batch_remove, names, False)
        await self._call(future, must_finish=False, timeout=self.deadline_s, names=names, lookup=True)

    def stats(self) -> MooncakeStats:
        return replace(
            self._stats,
            master_up=int(not self._failures),
            known_keys=len(self._known),
            capacity_bytes=self.segment_bytes,
        )

    # -- moving rows ------------------------------------------------------------------------

    async def _move(
        self, rows: Sequence[Row], blocking: Callable[..., list[int]], *, must_finish: bool, timeout: float
    ) -> list[int]:
        """Run ``blocking(names, views, addrs, slots)`` for the rows on a store thread: a code
        per row (``_SKIPPED`` for rows the call never reached, ``_LATE`` past ``timeout``)."""
        if not rows or not await self._usable(len(rows)):
            return [_SKIPPED] * len(rows)
        views, addrs = self._host.rows(rows)  # a row outside the host buffer fails here
        names = [object_key(self.namespace, bytes(key)) for key, _ in rows]
        headers = self._headers
        assert headers is not None
        slots = headers.take(len(rows))
        if slots is None:
            log.warning(
                "mooncake tier: over %d rows in flight; %d not moved", self.max_rows_in_flight, len(rows)
            )
            return [_SKIPPED] * len(rows)
        future = self._pool().submit(blocking, names, views, addrs, slots)
        future.add_done_callback(lambda _f: headers.give(slots))
        codes = await self._call(future, must_finish=must_finish, timeout=timeout, names=names)
        return codes if codes is not None else [_LATE] * len(rows)

    def _put_blocking(
        self, names: list[str], views: list[memoryview], addrs: list[int], slots: list[int]
    ) -> list[int]:
        """Stage each row's header (checksummed here, GIL released) and put header + row."""
        headers = self._headers
        assert headers is not None
        for view, addr, slot in zip(views, addrs, slots, strict=True):
            headers.view(slot)[:] = RowHeader(self.layout_id, len(view), checksum_at(view, addr)).pack()
        return self._store.batch_put_from_multi_buffers(
            names,
            [[headers.addr + slot * _HEADER_SLOT, addr] for slot, addr in zip(slots, addrs, strict=True)],
            [[HEADER_BYTES, len(view)] for view in views],
            self._put_config,
        )

    def _get_blocking(
        self,
        names: list[str],
        views: list[memoryview],
        addrs: list[int],
        slots: list[int],
        *,
        served: list[bytes | None],
        avoid: frozenset[str] = frozenset(),
    ) -> list[int]:
        """Get header + row (of the objects not held only on the hosts in ``avoid``:
        ``_SKIPPED_HOST``), verify each row that landed (``_VERIFIED``, ``_FOREIGN`` for a
        sound row of a layout we cannot use, or ``_CORRUPT``; other codes are the store's),
        note each verified row's layout in ``served``, and remove corrupt objects."""
        headers = self._headers
        assert headers is not None
        asked = range(len(names))
        codes = [_SKIPPED_HOST] * len(names)
        if avoid:  # ask where the objects are, and leave those held only on resting hosts
            hosts = replica_hosts(self._store.batch_get_replica_desc(names))
            asked = [n for n, name in enumerate(names) if not (name in hosts and hosts[name] <= avoid)]
        if asked:
            answers = self._store.batch_get_into_multi_buffers(
                [names[n] for n in asked],
                [[headers.addr + slots[n] * _HEADER_SLOT, addrs[n]] for n in asked],
                [[HEADER_BYTES, len(views[n])] for n in asked],
            )
            for n, code in zip(asked, answers, strict=True):
                codes[n] = code
        corrupt: list[str] = []
        for n, (name, view, addr, slot) in enumerate(zip(names, views, addrs, slots, strict=True)):
            if codes[n] != HEADER_BYTES + len(view):
                continue
            header = RowHeader.unpack(headers.view(slot))
            if header is not None and header.layout_id not in self.layouts:
                codes[n] = _FOREIGN  # another engine's row: not ours to judge, nor to remove
                continue
            why = verify(header, self.layouts, view, lambda v, a=addr: checksum_at(v, a))
            codes[n] = _VERIFIED if why is None else _CORRUPT
            if why is None:
                served[n] = header.layout_id  # type: ignore[union-attr]
            else:
                corrupt.append(name)
                log.warning("mooncake tier: object %s refused (%s): a miss; removing it", name, why)
        if corrupt:
            self._store.batch_remove(corrupt, True)  # forced: nobody should read it, lease or not
        return codes

    # -- the store's health -----------------------------------------------------------------

    async def _call(
        self,
        future: concurrent.futures.Future,
        *,
        must_finish: bool,
        timeout: float,
        names: list[str],
        lookup: bool = False,
    ) -> Any:
        """The result of a store call, or ``None`` if it missed ``timeout``.

        A call still queued then is cancelled (the store's threads were busy: no verdict on
        anything). One that started and overran is judged (``_judge_overrun``): the master
        is down only if it does not answer a probe; otherwise the hosts holding ``names``
        rest (not after a ``lookup``: a call only the master serves). With ``must_finish``
        (a get, which writes host rows) the call is waited for ``late_get_grace_s`` more,
        then given up on: ``RowsAbandoned``."""
        waiter = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waiter}, timeout=max(0.0, timeout))
        if done:
            return waiter.result()
        self._stats.timeouts += 1
        if future.cancel():
            return None
        what = "lookup" if lookup else "get" if must_finish else "put"
        judging = asyncio.ensure_future(self._judge_overrun(names, what, blame_hosts=not lookup))
        if not must_finish:
            waiter.add_done_callback(_ignore_result)
            return None
        done, _ = await asyncio.wait({waiter}, timeout=self.late_get_grace_s)
        if done:  # the store's own timeouts ended it: its answer stands
            return waiter.result()
        waiter.add_done_callback(_ignore_result)
        self._stats.abandoned += len(names)
        await asyncio.wait({judging}, timeout=0.1)
        hosts = judging.result() if judging.done() else None
        raise RowsAbandoned(
            f"mooncake tier: a get of {len(names)} rows still ran {timeout + self.late_get_grace_s:.1f} s "
            f"after it started ({self._fault_text(hosts)}); it may still write those rows",
            [False] * len(names),
            ended=future,
        )

    async def _judge_overrun(self, names: list[str], what: str, *, blame_hosts: bool) -> list[str] | None:
        """After a call overran: a master that does not answer a cheap question (where do
        these objects live?) within ``probe_timeout_s`` is down; one that answers names the
        storage hosts at fault, which rest (``SuspectHosts``): those it returns. One judgement
        at a time."""
        if self._judging or self._prober is None:
            return None
        self._judging = True
        try:
            probe = asyncio.wrap_future(self._prober.submit(self._where_blocking, names[:PROBE_NAMES]))
            done, _ = await asyncio.wait({probe}, timeout=self.probe_timeout_s)
            if not done or probe.exception() is not None:
                probe.add_done_callback(_ignore_result)
                self._mark_down(
                    f"a {what} overran its {self.deadline_s:.1f} s deadline and the master {self.master} "
                    f"did not answer a probe in {self.probe_timeout_s:.1f} s"
                )
                return None
            if not blame_hosts:
                log.warning("mooncake tier: a %s overran its deadline; the master answers now", what)
                return None
            hosts = sorted(set().union(*probe.result().values()))
            self._stats.host_faults += 1
            if hosts:  # a put's objects are not placed yet: the host of the last verdict stays named
                self.fault_hosts = hosts
            rest = self._suspects.suspect(hosts)
            log.warning(
                "mooncake tier: a %s of %d rows overran its %.1f s deadline; the master %s answers: %s%s",
                what,
                len(names),
                self.deadline_s,
                self.master,
                self._fault_text(hosts),
                f"; gets skip objects held only there for {rest:.1f} s" if hosts else "",
            )
            return hosts
        finally:
            self._judging = False

    def _where_blocking(self, names: list[str]) -> dict[str, set[str]]:
        return replica_hosts(self._store.batch_get_replica_desc(names))

    @staticmethod
    def _fault_text(hosts: list[str] | None) -> str:
        if hosts:
            return f"storage host {', '.join(hosts)} holds its objects and did not finish"
        return "the store does not say which storage host holds its objects"

    def suspect_hosts(self) -> frozenset[str]:
        """The storage hosts (transfer endpoints) gets avoid now (``SuspectHosts``)."""
        return self._suspects.active()

    async def _usable(self, rows: int) -> bool:
        """Whether to call the store now: not while it is down and its backoff runs, and after
        the backoff only once the master's port answers (a call to a dead master blocks ~4 s
        while the store reconnects)."""
        if self._store is None:
            raise TierError("the mooncake tier is not open")
        if not self._failures:
            return True
        if time.monotonic() >= self._retry_at and not self._knocking:
            self._knocking = True
            try:
                reachable = await self._master_reachable(min(self.deadline_s, 1.0))
            finally:
                self._knocking = False
            if reachable:
                return True  # the first answer that is not "master lost" books the recovery
            self._mark_down(f"no master listens at {self.master}")
        self._stats.skipped_down += rows
        return False

    def _note_master(self, codes: Sequence[int]) -> None:
        """Book what a call's codes say about the master: lost, or (after an outage) back."""
        if codes and all(code in _MASTER_LOST for code in codes):
            self._mark_down(f"master {self.master} unreachable ({codes[0]})")
        elif self._failures and any(code not in _MASTER_LOST and code not in _NOT_ASKED for code in codes):
            self._failures = 0
            self._stats.recoveries += 1
            log.warning("mooncake tier: master %s answers again", self.master)

    def _mark_down(self, reason: str) -> None:
        self._failures += 1
        self._stats.master_lost += 1
        self._retry_at = self._backoff.retry_at(self._failures)
        log.warning("mooncake tier down: %s; next try in %.1f s", reason, self._backoff.delay(self._failures))

    # -- helpers ----------------------------------------------------------------------------

    async def _master_reachable(self, timeout: float) -> bool:
        """Whether the master's port takes a TCP connection within ``timeout`` (on the event loop:
        no store thread is needed, so a knock never queues behind a stuck call)."""
        try:
            connecting = asyncio.open_connection(self.master.host, self.master.port)
            _, writer = await asyncio.wait_for(connecting, timeout)
        except (OSError, ValueError, TimeoutError):
            return False
        writer.close()
        return True

    def _pool(self) -> _Workers:
        if self._workers is None:
            raise TierError("the mooncake tier is not open")
        return self._workers


_KEPT: list[Any] = []


def _keep_forever(store: Any) -> None:
    """Never let ``store`` be destroyed, not even at interpreter exit (see ``close``)."""
    _KEPT.append(store)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))


def _ignore_result(waiter: asyncio.Future) -> None:
    if not waiter.cancelled():
        waiter.exception()  # retrieved: a late failure is not "never retrieved"
