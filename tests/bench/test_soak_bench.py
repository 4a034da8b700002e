"""``bench.soak``'s bookkeeping, without a server: per-process RSS by kind, the flatness table
over them, and the control's options."""

import os
import subprocess
import sys
import threading

import pytest

from bench.soak import _rss_kinds, _still_running, _tree, flatness, parse_args, process_series


def _sample(t_s: float, engine_anon_mib: float) -> dict:
    mib = 2**20
    return {
        "t_s": t_s,
        "server": {
            "rss": 0,
            "fds": 10,
            "threads": 5,
            "processes": 2,
            "rss_by_name": {
                "server": {"rss": 100 * mib, "anon": 90 * mib, "file": 10 * mib, "shmem": 0},
                "VLLM::EngineCore": {
                    "rss": int((engine_anon_mib + 20) * mib),
                    "anon": int(engine_anon_mib * mib),
                    "file": 4 * mib,
                    "shmem": 16 * mib,
                },
            },
        },
        "peer": {"rss": 0, "fds": 0, "threads": 0},
        "shm_kvtier_bytes": 0,
        "shm_used_bytes": 0,
        "disk_tier_bytes": 0,
    }


def test_flatness_has_a_row_per_process_and_kind_and_shows_which_grew():
    samples = [_sample(t, 500 + t) for t in (0, 10, 20, 30, 40)]  # the engine's heap: +1 MiB a second
    table = flatness(samples, warm_up_s=10)
    assert table["VLLM::EngineCore anon (MiB)"]["last_minus_first"] == pytest.approx(30)
    assert table["VLLM::EngineCore shmem (MiB)"]["last_minus_first"] == 0
    assert table["server anon (MiB)"]["second_half_spread"] == 0
    assert set(process_series(samples)) >= {f"server {k} (MiB)" for k in ("rss", "anon", "file", "shmem")}


def test_tree_reports_this_process_by_kind():
    tree = _tree(os.getpid())
    mine = tree["rss_by_name"]["server"]  # the root of the tree is named "server"
    assert mine["rss"] > 0 and mine["anon"] > 0
    assert _rss_kinds(os.getpid()).keys() == {"anon", "file", "shmem"}


def test_control_and_server_env_options():
    args = parse_args(["--minutes", "1", "--no-kvtier", "--server-env", "MALLOC_ARENA_MAX=2"])
    assert args.no_kvtier and args.server_env == [("MALLOC_ARENA_MAX", "2")]
    with pytest.raises(SystemExit):
        parse_args(["--server-env", "NOVALUE"])


def test_a_process_that_exits_within_the_grace_is_not_left_running():
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        waiter = threading.Thread(target=quick.wait)  # reap it, as its parent would
        waiter.start()
        assert _still_running([quick.pid, slow.pid], grace_s=3.0) == [slow.pid]
        waiter.join()
    finally:
        slow.kill()
        slow.wait()
