"""`tokenmill bench --quick` for real on the default model, on a terminal (the estimate, the
progress bar, the table and the report's shape; never timings), and the time estimate's
arithmetic on hand-made speeds."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

from tokenmill import cli
from tokenmill.bench import estimate
from tokenmill.bench.command import apply_preset
from tokenmill.bench.engines import installed_peers
from tokenmill.bench.protocol import PEERS, PRESETS, WARMUP_REQUESTS, WARMUP_TOKENS

QUICK = {option: fast for option, (_, fast) in PRESETS.items()}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_on_a_terminal(args: list[str], cwd, columns: int = 220) -> tuple[int, str]:
    """Run `python -m tokenmill.cli ARGS` with stdout and stderr on a pseudo-terminal, as a
    user's shell runs it; its exit status and everything it wrote, ANSI codes removed."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm-256color"}
    for name in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # rich reads these
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", *args],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd, env=env,
    )  # fmt: skip
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    status = proc.wait(timeout=60)
    return status, ANSI.sub("", b"".join(chunks).decode(errors="replace"))


@pytest.mark.slow
def test_quick_bench_on_the_default_model(tmp_path):
    report_path = tmp_path / "bench.json"
    status, out = run_on_a_terminal(["bench", "--quick", "--json", str(report_path)], tmp_path)
    assert status == 0, out[-3000:]

    # Before the timed runs: how long they take; during them: a progress bar.
    assert re.search(
        r"tokenmill bench: this will take (about \d+ minutes?|under a minute) more", out
    )
    assert "--quick takes" not in out  # that comparison is for the full run
    assert re.search(r"tokenmill latency @128 run \d/2 .*━.*\d+%.* left", out), out[-3000:]

    report = json.loads(report_path.read_text())
    settings = report["settings"]
    assert settings["quick"] is True
    assert settings["prompt_lens"] == QUICK["prompt_len"] and settings["runs"] == QUICK["runs"]
    assert settings["gen_len"] == QUICK["gen_len"]
    assert settings["num_requests"] == QUICK["num_requests"]
    assert report["machine"]["bandwidth_buffer_mib"] == QUICK["bandwidth_mib"]
    assert report["machine"]["gemm_size"] == QUICK["gemm_size"]

    # Only the peers already installed run; the others are listed as skipped, with why.
    engines = report["engines"]
    running = ["tokenmill", *installed_peers()]
    assert list(engines) == running + [p for p in PEERS if p not in running]
    for name, entry in engines.items():
        if name in running:
            assert entry["status"] == "ok", (name, entry)
            assert list(entry["latency"]) == ["128"]
            assert [r["output_tokens"] for r in entry["latency"]["128"]["runs"]] == [32, 32]
            assert entry["throughput"]["requests"] == QUICK["num_requests"]
        else:
            assert entry["status"] == "skipped" and "--install-peers" in entry["reason"]

    est = report["estimate"]
    assert set(est["per_engine_s"]) == set(running)
    assert est["remaining_s"] > 0 and est["took_s"] > 0 and est["quick_total_s"] is None

    # The table: its title, its columns, one row per engine that ran, every row as wide
    # as the header.
    assert "tokenmill bench: SmolLM2-135M-Instruct.Q4_1.gguf, float32 (--quick" in out
    header = next(line for line in out.splitlines() if line.startswith("┃") and "engine" in line)
    columns = [c.strip() for c in header.strip("┃ \r").split("┃")]
    assert columns == [
        "engine", "kernels", "TTFT ms @128", "prefill tok/s @128", "decode tok/s",
        "ceiling tok/s", "vs ceiling", "vs tokenmill", "throughput tok/s (8 req)",
        "peak RSS MiB",
    ]  # fmt: skip
    rows = [line.strip("│ \r").split("│") for line in out.splitlines() if line.startswith("│")]
    assert [r[0].strip() for r in rows] == running
    assert all(len(r) == len(columns) for r in rows)
    # a figure over the runs: its median, and the lowest-highest run when they differ
    number = r"[\d,.]+x?( \([\d,.]+-[\d,.]+\))?"
    assert all(re.fullmatch(number, cell.strip()) for r in rows for cell in r[2:])


def test_quick_fills_only_what_the_command_line_left_out():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "--runs", "7", "--peers", "none"])
    assert apply_preset(args) == {}
    assert args.runs == 7 and args.peers == []
    assert args.gen_len == QUICK["gen_len"] and args.prompt_len == QUICK["prompt_len"]

    full = parser.parse_args(["bench"])
    assert apply_preset(full) == {}
    assert full.quick is False and full.peers == list(PEERS)
    assert (full.runs, full.prompt_len, full.gen_len) == (5, [128, 512], 128)

    quick = parser.parse_args(["bench", "--quick"])
    left_out = apply_preset(quick)
    assert quick.peers == installed_peers()
    assert set(left_out) == set(PEERS) - set(installed_peers())

    installing = parser.parse_args(["bench", "--quick", "--install-peers"])
    assert apply_preset(installing) == {} and installing.peers == list(PEERS)


def test_help_names_both_presets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--quick takes a few minutes" in text
    assert "(default 5; with --quick 2)" in text  # --runs


# ---------------------------------------------------------------------- the estimate


def speed(mode: dict, prefill=100.0, decode=10.0, batch_step=0.3, rows=8) -> estimate.Speed:
    return estimate.Speed(prefill, decode, batch_step, rows, mode)


def test_latency_and_sequential_throughput():
    s = speed({"mode": "sequential"})
    assert estimate.latency_run_s(s, 200, 11) == pytest.approx(200 / 100 + 10 / 10)
    requests = [(100, 5), (50, 3)]
    expected = sum(p / 100 + (n - 1) / 10 for p, n in requests)
    assert estimate.throughput_s(s, requests) == pytest.approx(2 * expected)  # + warm-up


def test_batched_step_is_linear_between_one_row_and_the_calibration():
    s = speed({"mode": "continuous", "max_seqs": 64})
    assert s.step_s(1) == pytest.approx(0.1)
    assert s.step_s(8) == pytest.approx(0.3)
    assert s.step_s(15) == pytest.approx(0.1 + 14 * 0.2 / 7)


def test_static_batches_pad_to_their_longest():
    s = speed({"mode": "static", "size": 2})
    requests = [(10, 5), (30, 3), (20, 9)]
    # batch 1: 2 x 30 prompt tokens, 4 steps of 2 rows; batch 2: 20 tokens, 8 steps of 1
    expected = 60 / 100 + 4 * s.step_s(2) + 20 / 100 + 8 * s.step_s(1)
    warm = [(p, min(n, WARMUP_TOKENS)) for p, n in requests[:WARMUP_REQUESTS]]
    assert estimate._requests_s(s, requests) == pytest.approx(expected)
    assert estimate.throughput_s(s, requests) == pytest.approx(
        expected + estimate._requests_s(s, warm)
    )


def test_continuous_batching_shrinks_as_sequences_finish():
    s = speed({"mode": "continuous", "max_seqs": 2})
    requests = [(10, 3), (10, 5), (10, 2)]
    # decode steps 2, 4, 1; two run at once: 2 steps of 2 rows (the first ends), then the
    # third joins: 1 step of 2 (it ends), then the second's last step alone
    expected = 30 / 100 + 2 * s.step_s(2) + 1 * s.step_s(2) + 1 * s.step_s(1)
    assert estimate._requests_s(s, requests) == pytest.approx(expected)


def test_speed_from_samples_bounds_the_batched_step():
    sample = {"ttft_s": 0.5, "decode_s": 3.1, "output_tokens": 32}  # 256 tok/s, 10 tok/s
    calib = {"requests": 8, "prompt_tokens": 16, "output_tokens": 8}
    s = estimate.speed(sample, {**calib, "wall_s": 0.5 + 7 * 0.3}, 128, {"mode": "static"})
    assert s.prefill_tok_s == pytest.approx(256) and s.decode_tok_s == pytest.approx(10)
    assert s.batch_step_s == pytest.approx((2.6 - 128 / 256) / 7)
    # a burst of other load during the calibration: no worse than 8 single steps
    slow = estimate.speed(sample, {**calib, "wall_s": 100.0}, 128, {"mode": "static"})
    assert slow.batch_step_s == pytest.approx(8 * 0.1)
    assert estimate.speed(
        sample, {**calib, "wall_s": 0.0}, 128, {"mode": "static"}
    ).batch_step_s == (pytest.approx(0.1))  # never faster than a single row's step
    seq = estimate.speed(sample, {**calib, "wall_s": 9.0}, 128, {"mode": "sequential"})
    assert seq.batch_step_s == pytest.approx(0.1)


def test_phases_skip_what_ran_and_what_is_skipped():
    speeds = {"a": speed({"mode": "sequential"})}
    one = estimate.latency_run_s(speeds["a"], 128, 32)
    lat = estimate.phases_s(speeds, [128], 2, 32, [], ["throughput"], done={128: 2})
    assert lat["a"] == pytest.approx(one)  # 3 rounds (warm-up and 2 runs), 2 done
    assert estimate.phases_s(speeds, [128], 2, 32, [(10, 2)], ["latency"])["a"] == (
        pytest.approx(estimate.throughput_s(speeds["a"], [(10, 2)]))
    )


def test_machine_scales_with_buffer_and_cube_of_gemm():
    measured = {"seconds": {"bandwidth": 4.0, "gemm": 8.0}, "bandwidth_buffer_mib": 2048}
    measured["gemm_size"] = 4096
    assert estimate.machine_s(measured, 512, 2048) == pytest.approx(1.0 + 1.0)


@pytest.mark.parametrize(
    "seconds, text",
    [(20, "under a minute"), (60, "about 1 minute"), (150, "about 2 minutes"),
     (3000, "about 50 minutes"), (3 * 3600, "about 3.0 hours")],
)  # fmt: skip
def test_minutes(seconds, text):
    assert estimate.minutes(seconds) == text
