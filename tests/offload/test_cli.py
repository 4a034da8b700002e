from offload.cli import main


def test_usage_lists_every_command(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in ("peer", "bench copy", "bench policy", "bench disk", "bench remote", "bench e2e"):
        assert name in out
    assert main(["--help"]) == 0


def test_unknown_command_and_benchmark(capsys):
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert main(["bench", "nope"]) == 2


def test_bench_runs_through_the_cli(tmp_path, capsys):
    out = tmp_path / "copy.json"
    assert main(["bench", "copy", "--blocks", "2", "--repeats", "1", "--json", str(out)]) == 0
    assert out.exists()
    assert "$ kvtier bench copy --blocks 2 --repeats 1" in capsys.readouterr().out


def test_peer_serves_prometheus_metrics(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    import pytest

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "UCX_NET_DEVICES": "lo"}
    argv = ["--listen", "127.0.0.1:0", "--capacity", "1MiB", "--row-bytes", "64KiB"]
    peer = subprocess.Popen(
        [sys.executable, "-m", "offload.cli", "peer", *argv, "--metrics-port", str(metrics_port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert "listening on" in peer.stdout.readline()
        deadline = time.monotonic() + 20
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the peer's metrics endpoint never answered")
                time.sleep(0.1)
        text = body.decode()
        assert "# TYPE kvtier_peer_slots gauge" in text
        assert "kvtier_peer_slots 16" in text
    finally:
        peer.terminate()
        assert peer.wait(timeout=20) == 0
