"""``kvtier bench convert`` runs end to end on a small load and writes its figures."""

import json

import pytest

from bench import convert


def test_convert_bench_writes_ratios_for_each_reader(tmp_path, capsys):
    out = tmp_path / "convert.json"
    assert (
        convert.main(["--rows", "2", "--repeats", "1", "--readers", "hnd-64,packed-16", "--json", str(out)])
        == 0
    )
    figures = json.loads(out.read_text())
    assert [r["reader"] for r in figures["readers"]] == ["hnd-64", "packed-16"]
    for reader in figures["readers"]:
        assert reader["load_gbps"] > 0 and reader["in_worker_gbps"] > 0 and reader["same_layout_gbps"] > 0
        assert reader["load_ratio"] == pytest.approx(reader["load_gbps"] / reader["same_layout_gbps"])
        assert reader["row_bytes"] == 8 << 20
    assert "kvtier bench convert" in capsys.readouterr().out


def test_a_reader_that_is_not_a_layout_is_refused():
    with pytest.raises(SystemExit, match="KIND-BLOCKTOKENS"):
        convert.main(["--readers", "nhd-48"])
    with pytest.raises(SystemExit, match="unknown engine layout"):
        convert.main(["--readers", "zigzag-16", "--rows", "1"])
