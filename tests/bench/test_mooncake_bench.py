import json

import pytest

pytest.importorskip("mooncake.store")

from bench.mooncake import main


@pytest.mark.multiprocess
def test_mooncake_bench_writes_ratios_against_the_store_and_the_peer_tier(tmp_path, capsys):
    out = tmp_path / "mooncake.json"
    assert main(["--rows", "4", "--row-bytes", "256KiB", "--repeats", "1", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    for name in ("put_gbps", "get_gbps", "store_put_gbps", "store_get_gbps", "checksum_gbps"):
        assert fig[name] > 0
    assert abs(fig["put_ratio"] - fig["put_gbps"] / fig["store_put_gbps"]) < 1e-9
    assert abs(fig["get_ratio"] - fig["get_gbps"] / fig["store_get_gbps"]) < 1e-9
    assert fig["peer_put_gbps"] > 0 and fig["peer_get_gbps"] > 0
    assert fig["verified"] is True and fig["target"] == 0.8 and fig["bytes_per_op"] == 4 * 256 * 1024
    printed = capsys.readouterr().out
    assert "$ kvtier bench mooncake" in printed and "ratio" in printed and "peer GB/s" in printed
