import json

import pytest
import torch

from bench.copy import main


def test_copy_bench_writes_figures_for_both_layouts(tmp_path, capsys):
    out = tmp_path / "copy.json"
    assert main(["--blocks", "4", "--repeats", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    layouts = figures["layouts"]
    assert set(layouts) == {"packed", "per_layer"}
    assert layouts["packed"]["segments_per_block"] == 1
    assert layouts["per_layer"]["segments_per_block"] == 32
    for fig in layouts.values():
        assert fig["block_bytes"] == 2 * 2**20
        assert fig["store_gbps"] > 0 and fig["load_gbps"] > 0 and fig["baseline_gbps"] > 0
        assert abs(fig["store_ratio"] - fig["store_gbps"] / fig["baseline_gbps"]) < 1e-9
        assert abs(fig["load_ratio"] - fig["load_gbps"] / fig["load_baseline_gbps"]) < 1e-9
    printed = capsys.readouterr().out
    assert "$ kvtier bench copy" in printed and "per_layer" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
@pytest.mark.parametrize("bench", ["copy", "convert"])
def test_device_cuda_without_cuda_is_a_clear_error(bench, capsys):
    from bench import convert, copy

    with pytest.raises(SystemExit):
        {"copy": copy.main, "convert": convert.main}[bench](["--device", "cuda"])
    assert "CUDA is not available here" in capsys.readouterr().err
