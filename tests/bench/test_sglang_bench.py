import json

from bench.sglang_backend import main


def test_sglang_bench_checks_bytes_and_writes_both_ratios(tmp_path, capsys):
    out = tmp_path / "sglang.json"
    argv = ["--pages", "3", "--page-tokens", "4", "--layers", "2", "--heads", "2", "--head-dim", "16"]
    assert main([*argv, "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["command"].startswith("kvtier bench sglang --pages 3")
    for what in ("set", "get"):
        ratio = figures[f"backend_{what}_gbps"] / figures[f"tier_{what}_gbps"]
        assert abs(figures[f"{what}_ratio"] - ratio) < 1e-9
    assert figures["row_bytes"] == 2 * 2 * 4 * 2 * 16 * 2  # K, V x layers x tokens x heads x dim x fp16
    assert list(tmp_path.iterdir()) == [out]  # the bench cleans up after itself
    assert "$ kvtier bench sglang --pages 3" in capsys.readouterr().out
