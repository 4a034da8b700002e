from offload.cli import main


def test_usage_lists_every_command(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in ("peer", "bench copy", "bench policy", "bench disk", "bench remote"):
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
