"""Membership at scale, for ``kvtier bench cluster --membership N``: peers killed,
partitioned, leaving and joining under a steady load, with a timeline.

An engine host runs ``SteadyLoad`` (``bench/cluster_engine.py``): every ``INTERVAL_S`` a get
of all its rows, then a put of the ones it missed. N peers serve it; one more is configured
but started only later (it joins). Events, ``EVENT_GAP_S`` apart: a peer killed, one cut off,
one leaving (SIGTERM), the killed one back (empty), the cut one healed (its rows still there),
the late one joining. Per event: the rows lost (the distinct rows missed, from the event
until the next one, owed to the peer that went or came: ``SteadyLoad``) against that peer's share (its
rows in the last get before, or the most after), and the other misses of that span; whether
any get took longer than its deadline plus ``SLACK_S``. Balance: max / mean rows per peer of
``BALANCE_KEYS`` keys over all the peers (rendezvous hashing, no transfer).
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.cluster_engine import NAMESPACE, key_of
from bench.cluster_net import Cluster, Host
from tiers.remote.routing import rendezvous_owner

INTERVAL_S = 0.1
EVENT_GAP_S = 1.5
SLACK_S = 1.5
BALANCE_KEYS = 16384
BALANCE_TARGET = 1.15


def balance(addresses: list[str], keys: int = BALANCE_KEYS) -> float:
    """Max over mean rows per peer when ``keys`` keys are spread over ``addresses``."""
    counts = dict.fromkeys(addresses, 0)
    for i in range(keys):
        counts[rendezvous_owner(NAMESPACE + key_of("balance", i), addresses)] += 1
    return max(counts.values()) / (keys / len(addresses))


def run(peers: int, rows: int, deadline_s: float, log_dir: Path) -> dict:
    """The events above over ``peers`` peers (at least 4) serving ``rows`` rows of 64 KiB."""
    if peers < 4:
        raise ValueError("membership needs at least 4 peers")
    with Cluster(peers + 2, log_dir / "membership") as cluster:
        engine_host, *peer_hosts = cluster.hosts
        late = peer_hosts[-1]
        started = cluster.start_peers(peer_hosts[:-1], capacity="16MiB", row_bytes="64KiB")
        processes = {host.index: process for host, process in zip(peer_hosts, started, strict=False)}
        engine = cluster.start_engine(
            engine_host, peer_hosts, rows=rows, row_bytes="64KiB", deadline_s=deadline_s, backoff_s=0.5
        )
        killed, cut, leaving = peer_hosts[0], peer_hosts[1], peer_hosts[2]

        def restart(host: Host) -> None:
            processes[host.index] = cluster.start_peer(host, capacity="16MiB", row_bytes="64KiB")

        events = [
            ("killed", killed, lambda: processes[killed.index].kill()),
            ("cut", cut, lambda: cluster.cut(cut)),
            ("left", leaving, lambda: processes[leaving.index].proc.terminate()),
            ("rejoined empty", killed, lambda: restart(killed)),
            ("healed", cut, lambda: cluster.heal(cut)),
            ("joined", late, lambda: restart(late)),
        ]
        engine.request({"op": "load_start", "salt": "steady", "interval_s": INTERVAL_S})
        began = time.monotonic()
        at: list[float] = []
        for _name, _host, act in events:
            time.sleep(max(0.0, began + (len(at) + 1) * EVENT_GAP_S - time.monotonic()))
            at.append(time.monotonic() - began)
            act()
        time.sleep(EVENT_GAP_S)
        timeline = engine.request({"op": "load_stop"}, timeout=120)["timeline"]
        addresses = [host.peer_address() for host in peer_hosts]
    rows_out = []
    for n, (name, host, _act) in enumerate(events):
        start, end = at[n], at[n + 1] if n + 1 < len(at) else float("inf")
        # By when each get ended: one in flight at the event already met it.
        before = [e for e in timeline if e["t"] + e["get_s"] < start]
        after = [e for e in timeline if start <= e["t"] + e["get_s"] < end]
        address = host.peer_address()
        comes_back = name in ("rejoined empty", "healed", "joined")
        # Its share: what it held before it went, or the most it owned after it came (while
        # another peer is still away, a newcomer owns more than it will at the end).
        sample = after if comes_back else before[-1:]
        share = max((e["owners"].get(address, 0) for e in sample), default=0)
        owed: dict[str, set[int]] = {}  # distinct rows missed, per peer they are owed to
        for entry in after:
            for peer, rows_missed in entry["missed_at"].items():
                owed.setdefault(peer, set()).update(rows_missed)
        lost = len(owed.get(address, ()))
        rows_out.append(
            {
                "event": name,
                "host": address,
                "t": start,
                "share": share,
                "rows_lost": lost,  # misses owed to this host
                "rows_lost_elsewhere": sum(len(v) for k, v in owed.items() if k != address),  # a late rejoin
                "within_share": lost <= share,
                "slowest_get_s": max((e["get_s"] for e in after), default=0.0),
            }
        )
    slowest = max(e["get_s"] for e in timeline)
    return {
        "peers": peers,
        "rows": rows,
        "deadline_s": deadline_s,
        "events": rows_out,
        "slowest_get_s": slowest,
        "stalls": sum(e["get_s"] > deadline_s + SLACK_S for e in timeline),
        "all_exact": all(e["exact"] for e in timeline),
        "balance": balance(addresses),
        "balance_keys": BALANCE_KEYS,
        "balance_target": BALANCE_TARGET,
        "timeline": [{k: v for k, v in e.items() if k != "owners"} for e in timeline],
        "event_times": at,
        "event_names": [name for name, _h, _a in events],
    }


def plot(figures: dict, path: Path) -> Path:
    """The timeline: hits and misses per get, each get's time, the events as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = figures["timeline"]
    t = [e["t"] for e in timeline]
    fig, (rows_ax, time_ax) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    rows_ax.plot(t, [e["hits"] for e in timeline], label="hits")
    rows_ax.plot(t, [e["misses"] for e in timeline], label="misses")
    rows_ax.plot(t, [e["peers_up"] * figures["rows"] / (figures["peers"] + 1) for e in timeline],
                 linestyle=":", label="peers up (scaled)")  # fmt: skip
    rows_ax.set_ylabel("rows per get")
    rows_ax.legend(loc="center right")
    time_ax.plot(t, [e["get_s"] * 1e3 for e in timeline], label="get")
    time_ax.axhline(figures["deadline_s"] * 1e3, color="grey", linestyle="--", label="deadline")
    time_ax.set_ylabel("ms per get")
    time_ax.set_xlabel("seconds")
    time_ax.legend(loc="upper right")
    for when, name in zip(figures["event_times"], figures["event_names"], strict=True):
        for ax in (rows_ax, time_ax):
            ax.axvline(when, color="red", alpha=0.4)
        rows_ax.annotate(name, (when, figures["rows"]), rotation=90, fontsize=8, va="top")
    fig.suptitle(f"{figures['peers']} peers under a steady load: kvtier bench cluster --membership")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
