"""The comm benchmark's pure parts: factors, config, alpha-beta fit, views."""

from __future__ import annotations

from pathlib import Path

import pytest

from manygpu.bench import report
from manygpu.bench.comm import (
    CommBenchConfig,
    CommRow,
    SweepConfig,
    bus_factor,
    memcpy_bytes,
    memcpy_gbs,
)
from manygpu.cli.bench import comm_config
from manygpu.cli.main import build_parser
from manygpu.errors import UsageError
from manygpu.flags import parse_size


def _row(nbytes: int, time_us: float, algorithm: str = "ring") -> CommRow:
    algbw = nbytes / time_us / 1e3
    return CommRow(
        op="all_reduce",
        algorithm=algorithm,
        bytes=nbytes,
        count=nbytes // 4,
        dtype="float32",
        ranks=4,
        time_us=time_us,
        algbw_gbs=algbw,
        busbw_gbs=algbw * 1.5,
        wrong=0,
    )


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 4) == 1.0


def test_sizes_double_and_iterations_adapt() -> None:
    cfg = SweepConfig(min_bytes=8, max_bytes=64)
    assert cfg.sizes() == [8, 16, 32, 64]
    assert cfg.iterations(8) > cfg.iterations(64 << 20)
    assert SweepConfig(iters=3).iterations(8) == 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"ops": ("allreduce",)}, "unknown op"),
        ({"algorithms": ("butterfly",)}, "unknown algorithm"),
        ({"min_bytes": 64, "max_bytes": 8}, "min bytes"),
        ({"dtype": "complex32"}, "dtype"),
    ],
)
def test_bad_sweep_config(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        SweepConfig(**kwargs)  # type: ignore[arg-type]


def test_parse_size() -> None:
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("1MB") == 1 << 20
    with pytest.raises(UsageError, match="not a size"):
        parse_size("12Q")


def test_alpha_beta_fit_recovers_the_model() -> None:
    alpha_us, gbs = 50.0, 0.125  # 1 Gbit/s
    rows = [_row(s, alpha_us + s / (gbs * 1e3)) for s in (1 << 20, 4 << 20, 16 << 20, 64 << 20)]
    fit = report.fit_alpha_beta(rows)
    assert fit.alpha_us == pytest.approx(alpha_us, rel=1e-3)
    assert fit.bandwidth_gbs == pytest.approx(gbs, rel=1e-6)
    assert fit.predict_us(8 << 20) == pytest.approx(alpha_us + (8 << 20) / 125.0, rel=1e-6)


def test_table_and_plot_views(tmp_path: Path) -> None:
    rows = [_row(1 << 10, 100.0), _row(1 << 20, 900.0), _row(1 << 10, 80.0, "native")]
    tbl = report.table(rows, "t")
    assert tbl.row_count == 3 and len(tbl.columns) == 9
    out = tmp_path / "plot.png"
    report.plot(rows, out, "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report.fits(rows)) == {"all_reduce/ring"}  # native has one size only


def test_each_row_is_one_line_under_the_header() -> None:
    """Rows are printed once, as measured, in columns that line up with the header."""
    header = report.header_line()
    for name in report.COLUMNS:
        assert name in header
    rows = [_row(8, 12.5), _row(64 << 20, 9e5, "native")]
    lines = [report.row_line(r) for r in rows]
    assert all("\n" not in ln for ln in lines)
    # Right-aligned columns end where their header ends.
    end = header.index("busbw") + len("busbw")
    for row, line in zip(rows, lines, strict=True):
        assert line[:end].endswith(report.human_rate(row.busbw_gbs))
        assert line.split()[:2] == [row.op, row.algorithm]


def test_no_file_unless_asked() -> None:
    assert CommBenchConfig().json_path == "" and CommBenchConfig().plot == ""
    assert CommBenchConfig().markdown == ""
    ns = build_parser().parse_args(["bench", "comm"])
    assert comm_config(ns).json_path == ""
    ns = build_parser().parse_args(["bench", "comm", "--json", "out/c.json"])
    assert comm_config(ns).json_path == "out/c.json"


def test_small_bandwidths_read_in_their_own_unit() -> None:
    """An 8-byte all-reduce moves KB/s, not "0.000 GB/s"."""
    assert report.human_rate(8 / 40e-6 / 1e9) == "200 KB/s"
    assert report.human_rate(0.0123) == "12.3 MB/s"
    assert report.human_rate(12.5) == "12.5 GB/s"
    assert report.human_rate(3e-9) == "3 B/s"
    assert report.human_rate(float("nan")) == "n/a"
    line = report.row_line(_row(8, 40.0))
    assert "0.000" not in line and "KB/s" in line


def test_plot_labels_sizes_as_people_write_them() -> None:
    assert [report.size_label(n) for n in (8, 1024, 1 << 20, 64 << 20, 3 << 30)] == [
        "8 B",
        "1 KiB",
        "1 MiB",
        "64 MiB",
        "3 GiB",
    ]
    fig = report.figure([_row(8, 10.0), _row(1 << 20, 900.0)], "t")
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert "1 KiB" in labels and not any("^" in t for t in labels), labels


def test_markdown_table_has_every_row_and_column() -> None:
    rows = [_row(8, 10.0), _row(1 << 20, 900.0)]
    lines = report.markdown(rows, "2 ranks, gloo").splitlines()
    assert lines[0] == "**2 ranks, gloo**"
    assert lines[2] == "| " + " | ".join(report.COLUMNS) + " |"
    assert lines[4:] == ["| " + " | ".join(report.cells(r)) + " |" for r in rows]
    ns = build_parser().parse_args(["bench", "comm", "--markdown", "out/c.md"])
    assert comm_config(ns).markdown == "out/c.md"


def test_memcpy_probe_follows_the_sweep() -> None:
    assert memcpy_bytes(64 << 10) == 64 << 10
    assert memcpy_bytes(8) == 4 << 10  # too small to time
    assert memcpy_bytes(1 << 40) == 256 << 20
    assert memcpy_gbs(4 << 10, repeats=2) > 0


def test_worker_writes_markdown_and_probes_the_largest_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real per-rank program, as one in-process gloo rank."""
    from manygpu.bench import comm_worker

    sweep = SweepConfig(algorithms=("native",), max_bytes=64 << 10, iters=1, warmup=0)
    md = tmp_path / "out" / "comm.md"
    assert comm_worker.main(CommBenchConfig(sweep=sweep, markdown=str(md))) == 0
    out = capsys.readouterr().out
    assert "a 64 KiB memcpy" in out and "256" not in out.split("local limit")[1]
    table = md.read_text().splitlines()
    assert table[0].startswith("**1 ranks, gloo") and len(table) == 4 + len(sweep.sizes())
