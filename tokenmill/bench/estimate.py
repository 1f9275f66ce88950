"""How long the rest of a bench run takes, from each engine's first runs.

Every engine first runs the first prompt length's warm-up and first timed round at batch
1 (prefill and decode speed, from the timed run: a cold first run is far slower), then
CALIBRATION_REQUESTS short requests at once, twice (protocol.py; the calibration, from
the second: how much longer a decode step of that batch takes than one of a single
sequence). A run's remaining work is then priced engine by engine:

  latency run      P / prefill + (G - 1) / decode
  throughput       by how the engine batches (its info's "batching"):
                   continuous  all requests at once, at most max_seqs running: the prompts
                               at the prefill rate, then one decode step per token of the
                               longest running sequence, a step of B sequences costing
                               step_s(B)
                   static      batches of `size`, each left-padded to its longest prompt
                               and run to its longest output
                   sequential  one request after another at batch 1
  machine          the measured bandwidth and GEMM times, scaled by buffer size and N^3

step_s(B) is linear between the batch-1 step (1 / decode) and the calibration's step of
CALIBRATION_REQUESTS rows: a decode step reads every weight once for the whole batch, and
its per-row work grows with B. The report keeps the estimate beside the time the run
took ("estimate" in --json).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.bench.protocol import WARMUP_REQUESTS, WARMUP_TOKENS

Requests = list[tuple[int, int]]  # (prompt tokens, output tokens) per request


@dataclass(frozen=True)
class Speed:
    """One engine's measured speed: batch-1 prefill and decode tokens/s, the seconds of a
    decode step over CALIBRATION_REQUESTS sequences, and how it batches."""

    prefill_tok_s: float
    decode_tok_s: float
    batch_step_s: float  # one decode step over `batch_rows` sequences
    batch_rows: int
    batching: dict

    def step_s(self, batch: int) -> float:
        """Seconds of one decode step over `batch` sequences."""
        one = 1 / self.decode_tok_s
        if self.batch_rows < 2:
            return one
        slope = max(0.0, self.batch_step_s - one) / (self.batch_rows - 1)
        return one + slope * (max(1, batch) - 1)


def speed(sample: dict, calibration: dict, prompt_len: int, batching: dict) -> Speed:
    """An engine's Speed from a warm batch-1 latency sample ({ttft_s, decode_s,
    output_tokens} at `prompt_len`) and its calibration reply ({wall_s, requests,
    prompt_tokens, output_tokens}: that many requests at once)."""
    prefill = prompt_len / sample["ttft_s"]
    decode = (sample["output_tokens"] - 1) / max(sample["decode_s"], 1e-9)
    one = 1 / decode
    rows = calibration["requests"]
    if batching["mode"] == "sequential" or rows < 2:  # every step is a batch-1 step
        return Speed(prefill, decode, one, 1, batching)
    # one batched prefill of every prompt, then a decode step per further token
    prompts_s = rows * calibration["prompt_tokens"] / prefill
    step = (calibration["wall_s"] - prompts_s) / max(1, calibration["output_tokens"] - 1)
    # A batched step costs at least a batch-1 step and at most `rows` of them (the rows
    # one after another); outside that the calibration caught a burst of other load.
    return Speed(prefill, decode, min(max(step, one), rows * one), rows, batching)


def latency_run_s(s: Speed, prompt_len: int, gen_len: int) -> float:
    return prompt_len / s.prefill_tok_s + (gen_len - 1) / s.decode_tok_s


def throughput_s(s: Speed, requests: Requests) -> float:
    """Seconds of the throughput phase, its warm-up included."""
    warmup = [(p, min(n, WARMUP_TOKENS)) for p, n in requests[:WARMUP_REQUESTS]]
    return _requests_s(s, warmup) + _requests_s(s, requests)


def _requests_s(s: Speed, requests: Requests) -> float:
    mode = s.batching["mode"]
    if not requests:
        return 0.0
    if mode == "sequential":
        return sum(latency_run_s(s, p, n) for p, n in requests)
    if mode == "static":
        size, total = s.batching["size"], 0.0
        for i in range(0, len(requests), size):
            batch = requests[i : i + size]
            width = max(p for p, _ in batch)
            total += len(batch) * width / s.prefill_tok_s
            total += (max(n for _, n in batch) - 1) * s.step_s(len(batch))
        return total
    # continuous: every prompt prefilled, then steps over the sequences still running
    total = sum(p for p, _ in requests) / s.prefill_tok_s
    waiting = [n - 1 for _, n in reversed(requests)]  # decode steps; pop() keeps the order
    running: list[int] = []  # the step on which each running sequence ends
    step = 0
    while waiting or running:
        while waiting and len(running) < s.batching["max_seqs"]:
            running.append(step + waiting.pop())
        end = min(running)  # every running sequence steps until the next one ends
        total += (end - step) * s.step_s(len(running))
        step = end
        running = [r for r in running if r > end]
    return total


def phases_s(
    speeds: dict[str, Speed],
    prompt_lens: list[int],
    runs: int,
    gen_len: int,
    requests: Requests,
    skip: list[str],
    done: dict[int, int] | None = None,
) -> dict[str, float]:
    """{engine: seconds} of the latency and throughput phases; `done`: {prompt length:
    rounds already run, the warm-up included} (not priced)."""
    out = {}
    for name, s in speeds.items():
        total = 0.0
        if "latency" not in skip:
            for p in prompt_lens:
                rounds = runs + 1 - (done or {}).get(p, 0)
                total += rounds * latency_run_s(s, p, gen_len)
        if "throughput" not in skip:
            total += throughput_s(s, requests)
        out[name] = total
    return out


def machine_s(measured: dict, buffer_mib: int, gemm_size: int) -> float:
    """Seconds of the machine measurements at other sizes, from a measured run's times."""
    seconds = measured["seconds"]
    bandwidth = seconds["bandwidth"] * buffer_mib / measured["bandwidth_buffer_mib"]
    return bandwidth + seconds["gemm"] * (gemm_size / measured["gemm_size"]) ** 3


def minutes(seconds: float) -> str:
    """'about 2 minutes', 'under a minute', 'about 1.5 hours'."""
    if seconds < 60:
        return "under a minute"
    if seconds < 90 * 60:
        n = round(seconds / 60)
        return f"about {n} minute{'s' if n != 1 else ''}"
    return f"about {seconds / 3600:.1f} hours"
