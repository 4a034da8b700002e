import json

import pytest

from bench.remote import main


@pytest.mark.multiprocess
def test_remote_bench_writes_ratios_against_raw_nixl(tmp_path, capsys):
    out = tmp_path / "remote.json"
    assert main(["--rows", "4", "--row-bytes", "256KiB", "--repeats", "1", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    for name in (
        "put_gbps",
        "get_gbps",
        "raw_write_gbps",
        "raw_read_gbps",
        "checksum_gbps",
        "raw_read_checked_gbps",
    ):
        assert fig[name] > 0
    assert abs(fig["put_ratio"] - fig["put_gbps"] / fig["raw_write_gbps"]) < 1e-9
    assert abs(fig["get_ratio"] - fig["get_gbps"] / fig["raw_read_gbps"]) < 1e-9
    # measured ceilings: raw moved in the tier's parts, each part checksummed (noisy at this size)
    assert fig["put_ceiling"] == fig["raw_write_checked_gbps"] / fig["raw_write_gbps"] > 0
    assert fig["get_ceiling"] == fig["raw_read_checked_gbps"] / fig["raw_read_gbps"] > 0
    assert fig["descriptors_per_transfer"] == 4  # 1 MiB fits one NIXL request, one descriptor per row
    assert fig["raw_descriptors_per_transfer"] == 4
    assert fig["verified"] is True and fig["target"] == 0.8
    assert fig["checksum_thread"] == "on" and 0 <= fig["parts_checksummed_beside"] <= 1
    printed = capsys.readouterr().out
    assert "$ kvtier bench remote" in printed and "ratio" in printed
