import json

from bench.disk import main


def test_disk_bench_writes_ratios_for_both_fsync_policies(tmp_path, capsys):
    out = tmp_path / "disk.json"
    argv = ["--rows", "8", "--row-bytes", "65536", "--batch", "4", "--rounds", "1"]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["command"].startswith("kvtier bench disk --rows 8")
    assert set(figures["policies"]) == {"nosync", "fsync"}
    assert figures["headline_policy"] == "nosync"
    for fig in figures["policies"].values():
        for side in ("write", "read", "warm_read"):
            assert fig[f"{side}_gbps"] > 0 and fig[f"plain_{side}_gbps"] > 0
            assert abs(fig[f"{side}_ratio"] - fig[f"{side}_gbps"] / fig[f"plain_{side}_gbps"]) < 1e-9
    assert figures["write_ratio"] == figures["policies"]["nosync"]["write_ratio"]
    assert figures["read_ratio"] == figures["policies"]["nosync"]["read_ratio"]
    assert list(tmp_path.iterdir()) == [out]  # the bench cleans up after itself
    printed = capsys.readouterr().out
    assert "$ kvtier bench disk --rows 8" in printed and "fsync" in printed
