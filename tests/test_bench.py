"""`megaport bench`: option parsing, and one small real run on a ported PyPI tree (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from megaport.cli import main
from megaport.commands.bench import parse_dtypes, parse_shape
from megaport.errors import MegaportError


def ported_016(tmp_path, core_upstream):
    """core_v0.16.1 ported from the PyPI-built upstream, in ``tmp_path / "tree"``."""
    tree = tmp_path / "tree"
    applied = CliRunner().invoke(main, ["apply", "--ref", "core_v0.16.1", "--repo", str(core_upstream),
                                        "--dest", str(tree)], catch_exceptions=False)
    assert applied.exit_code == 0, applied.output
    return tree


def test_parse_shape():
    assert parse_shape("1,16,1024,1024") == (1, 16, 1024, 1024)
    assert parse_shape("16, 1024, 1024") == (1, 16, 1024, 1024)  # [b*np, sq, sk]
    for bad in ("", "1,2", "1,2,3,4,5", "a,b,c,d", "1,0,4,4"):
        with pytest.raises(MegaportError) as err:
            parse_shape(bad)
        assert err.value.exit_code == 2


def test_parse_dtypes():
    assert parse_dtypes("bf16,fp32") == ["bf16", "fp32"]
    assert parse_dtypes("bfloat16, half,fp32,fp32") == ["bf16", "fp16", "fp32"]
    with pytest.raises(MegaportError):
        parse_dtypes("int8")


def test_bench_refuses_a_causal_shape_that_is_not_square(tmp_path):
    from test_verify_cli import fake_tree

    result = CliRunner().invoke(main, ["bench", str(fake_tree(tmp_path)), "--shape", "1,2,8,16"])
    assert result.exit_code == 2 and "--causal needs sq == sk" in result.output


@pytest.mark.upstream
def test_bench_measures_both_paths_on_cpu(tmp_path, core_upstream):
    pytest.importorskip("torch")
    tree = ported_016(tmp_path, core_upstream)
    report = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "megaport.cli", "bench", str(tree), "--device", "cpu",
                           "--shape", "1,4,64,64", "--dtype", "bf16,fp32", "--repeats", "3", "--json", str(report)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    document = json.loads(report.read_text())
    assert document["shape"] == [1, 4, 64, 64] and document["mask"] == "causal"
    assert [r["dtype"] for r in document["results"]] == ["bf16", "fp32"]
    for row in document["results"]:
        assert row["replacement_ms"] > 0 and row["upstream_torch_ms"] > 0
        assert len(row["samples_ms"]["fused"]) == len(row["samples_ms"]["torch"]) == 3
        assert row["time_ratio"] == pytest.approx(row["replacement_ms"] / row["upstream_torch_ms"], rel=1e-2)
        assert row["replacement_peak_mib"] is not None and row["upstream_torch_peak_mib"] is not None
        # Bandwidth against a plain copy of the input, and extra memory per input byte.
        assert row["copy_gbps"] > 0 and row["input_mib"] > 0
        # the ratio is rounded to 3 decimals and each GB/s to 2, which on a loaded machine (0.01 GB/s)
        # is most of the value: compare within what the rounding can move it
        assert row["replacement_bandwidth_vs_copy"] == pytest.approx(
            row["replacement_gbps"] / row["copy_gbps"], rel=1e-2, abs=1e-3 + 0.005 / row["copy_gbps"])
        assert row["replacement_extra_memory_x_input"] == pytest.approx(
            row["replacement_peak_mib"] / row["input_mib"], rel=2e-2)
    assert "RSS" in document["memory_method"]
    assert document["load_average"]["cpus"] >= 1
    assert "forward_torch_softmax" in document["variants"]["upstream_torch"]
    assert "time ratio" in proc.stdout and "peak memory" in proc.stdout


@pytest.mark.upstream
def test_bench_train_compares_the_port_with_upstream_fusions_off(tmp_path, core_upstream):
    """Both sides run, side by side, with the same losses; the tree is not touched."""
    pytest.importorskip("torch")
    tree = ported_016(tmp_path, core_upstream)
    status_before = subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True,
                                   text=True).stdout
    report = tmp_path / "bench-train.json"
    proc = subprocess.run([sys.executable, "-m", "megaport.cli", "bench", "--train", str(tree), "--device", "cpu",
                           "--layers", "1", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "2",
                           "--steps", "4", "--warmup", "1", "--json", str(report)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "upstream, fusions off" in proc.stdout and "ratio" in proc.stdout
    document = json.loads(report.read_text())
    ported, upstream = document["ported"], document["upstream_fusions_off"]
    assert upstream["what"] == "megaport's harness on the unported upstream commit, fusions off"
    assert upstream["baseline_shims"] == []  # core 0.16.1 starts on this stack as it is
    assert len(ported["losses"]) == len(upstream["losses"]) == 4
    assert document["loss_parity"]["max_relative_difference"] <= 0.01
    for key in ("ms_per_iter", "tokens_per_s", "peak_memory"):
        assert document["ratio"][key] > 0
    assert document["ratio"]["ms_per_iter"] == pytest.approx(ported["ms_per_iter"] / upstream["ms_per_iter"])
    assert subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True,
                          text=True).stdout == status_before
    attention = document["attention"]
    assert any("scaled_dot_product_attention" in line for line in attention["ported"]), attention
    assert "unfused" in attention["upstream_fusions_off"]
    assert "ported attention: torch scaled_dot_product_attention" in proc.stdout


@pytest.mark.upstream
def test_bench_attention_times_sdpa_the_ports_softmax_and_upstreams_unfused_path(tmp_path, core_upstream):
    pytest.importorskip("torch")
    tree = ported_016(tmp_path, core_upstream)
    report = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "megaport.cli", "bench", "--attention", str(tree), "--device", "cpu",
                           "--shapes", "1,4,64;1,4,128", "--head-dim", "32", "--groups", "2", "--dtype", "bf16",
                           "--repeats", "2", "--json", str(report)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    document = json.loads(report.read_text())
    assert [(r["seq"], r["dtype"]) for r in document["results"]] == [(64, "bf16"), (128, "bf16")]
    for row in document["results"]:
        for variant in ("sdpa", "port_softmax", "upstream_unfused"):
            assert row[f"{variant}_ms"] > 0 and len(row["samples_ms"][variant]) == 2
            assert row[f"{variant}_peak_mib"] is not None
        assert row["sdpa_vs_unfused"] == pytest.approx(row["sdpa_ms"] / row["upstream_unfused_ms"], rel=1e-2)
        assert row["sdpa_backend"] in ("flash", "efficient", "math", "unknown")
    assert "sdpa/unfused" in proc.stdout


def test_bench_attention_refuses_bad_shapes_and_groups(tmp_path):
    from test_verify_cli import fake_tree

    tree = str(fake_tree(tmp_path))
    bad_shape = CliRunner().invoke(main, ["bench", "--attention", tree, "--shapes", "1,2"])
    assert bad_shape.exit_code == 2 and "b,heads,seq" in bad_shape.output
    bad_groups = CliRunner().invoke(main, ["bench", "--attention", tree, "--shapes", "1,4,64", "--groups", "3"])
    assert bad_groups.exit_code == 2 and "--groups 3 must divide" in bad_groups.output


def test_bench_train_refuses_sizes_that_cannot_work(tmp_path):
    from test_verify_cli import fake_tree

    result = CliRunner().invoke(main, ["bench", "--train", str(fake_tree(tmp_path)), "--device", "cpu",
                                       "--hidden", "100", "--heads", "3"])
    assert result.exit_code == 2 and "not a multiple of --heads" in result.output


def test_bench_train_of_a_family_whose_package_is_missing_is_a_one_line_error(tmp_path):
    """Stanford's MoE layers are MegaBlocks': without it, bench --train says so and stops."""
    from test_verify_cli import fake_tree

    tree = fake_tree(tmp_path)
    (tree / "pretrain_gpt.py").write_text("")
    (tree / "megatron/model").mkdir(parents=True)
    (tree / "megatron/model/megablocks_utils.py").write_text("")
    (tree / "megatron/arguments.py").write_text("group.add_argument('--moe-num-experts', type=int)\n")
    result = CliRunner().invoke(main, ["bench", "--train", str(tree), "--device", "cpu", "--model", "megablocks-moe"])
    assert result.exit_code == 2, result.output
    assert "needs megablocks, which is not installed here" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_bench_fusions_times_each_unfused_op_and_its_share(tmp_path):
    pytest.importorskip("torch")
    from rich.console import Console

    from megaport.commands.bench_fusions import FusionBenchOptions, bench_fusions

    report = tmp_path / "fusions.json"
    options = FusionBenchOptions(device="cpu", seq=32, batch=1, hidden=64, heads=4, groups=2, vocab=128, layers=2,
                                 repeats=1, compile=False, json_file=str(report))
    assert bench_fusions(options, Console(file=open(tmp_path / "out.txt", "w"))) == 0
    document = json.loads(report.read_text())
    ops = {r["op"]: r for r in document["results"]}
    assert set(ops) == {"RMSNorm", "SwiGLU", "RoPE (query and key)", "cross-entropy", "core attention (SDPA)",
                        "linear layers (GEMMs)"}
    assert ops["RMSNorm"]["per_iteration"] == 5 and ops["cross-entropy"]["per_iteration"] == 1
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] is None for r in document["results"])
    assert sum(r["share_of_estimated_iteration"] for r in document["results"]) == pytest.approx(1.0, abs=0.01)
    assert document["options"]["ffn"] == 192  # Llama's 8/3 of hidden, rounded up to 64


def test_bench_fusions_refuses_shapes_that_do_not_divide():
    from megaport.commands.bench_fusions import FusionBenchOptions, bench_fusions

    with pytest.raises(MegaportError) as err:
        bench_fusions(FusionBenchOptions(hidden=100, heads=3), None)
    assert err.value.exit_code == 2


def test_bench_train_sides_start_fp16_at_parity_loss_scale(monkeypatch, tmp_path):
    """Both sides of bench --train start fp16's loss scale where no step overflows: at upstream's
    2**32 a ten-step fp16 run (the 2021-2022 GPT examples) skips every step and logs no loss."""
    from megaport.commands import bench_train
    from megaport.train import baseline, parity, pretrain

    seen = []
    monkeypatch.setattr(pretrain, "run_pretrain", lambda run, env: seen.append(run) or {})
    monkeypatch.setattr(baseline, "run_unported", lambda run, sha: (seen.append(run) or {}, []))
    sizes = {"layers": 2, "hidden": 64, "heads": 4, "seq": 128, "batch": 2, "steps": 4, "warmup": 1}
    for which in ("ported", "upstream"):
        bench_train._pretrain_side(tmp_path, "0" * 40, which, {}, sizes, "cpu")
    assert [run.mode for run in seen] == ["ported", "fusions-off"]
    assert all(run.initial_loss_scale == parity.PARITY_LOSS_SCALE for run in seen)
