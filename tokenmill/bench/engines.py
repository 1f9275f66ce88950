"""Starting the workers (tokenmill and its peers), each in its own process, and driving
them one command at a time, the latency runs interleaved round by round."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenmill.bench.protocol import LLAMA_CPP_CMAKE_ARGS, PEERS, REPLY

# ---------------------------------------------------------------------- driving the workers

# Before each timed run: the previous engine's idle threads spin on for some milliseconds
# (libgomp's and ggml's spin-waits, ~20 ms), taking a core from the next engine's first
# step, and tokenmill counts them as a neighbour's load (engine/free_cores.py)
SETTLE_S = 0.05


def log(message: str) -> None:
    print(f"tokenmill bench: {message}", file=sys.stderr, flush=True)


def installed_peers() -> list[str]:
    """The peers whose package this environment has (what --quick runs by default)."""
    return [name for name, (module, _) in PEERS.items() if importlib.util.find_spec(module)]


def resolve_peers(
    names: list[str], install: bool, model: Path
) -> tuple[list[str], dict[str, dict]]:
    """The peers to run, and {peer: skipped entry} for the others (each with a reason)."""
    run, skipped = [], {}
    for name in names:
        module, packages = PEERS[name]
        reason = None
        if name == "llamacpp" and model.suffix != ".gguf":
            reason = "llama.cpp needs a .gguf model"
        elif importlib.util.find_spec(module) is None:
            reason = (
                install_peer(name)
                if install
                else f"not installed (pip install {' '.join(packages)}, or --install-peers)"
            )
        if reason is None:
            run.append(name)
        else:
            log(f"skipping {name}: {reason}")
            skipped[name] = {"status": "skipped", "reason": reason}
    return run, skipped


def install_peer(name: str) -> str | None:
    """pip install a peer into this environment; None on success, else why it failed."""
    packages = PEERS[name][1]
    env = dict(os.environ)
    if name == "llamacpp":
        env.setdefault("CMAKE_ARGS", LLAMA_CPP_CMAKE_ARGS)
        log("installing llama-cpp-python (compiles llama.cpp: several minutes)")
        packages = ["--no-cache-dir", *packages]  # a cached wheel may lack these flags
    else:
        log(f"installing {' '.join(packages)}")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", *packages], env=env, capture_output=True, text=True
    )
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"pip install {' '.join(packages)} failed: {last}"


class WorkerError(RuntimeError):
    """A worker died; the message says how, with its last line of output."""


class Worker:
    """One engine's subprocess, driven one command at a time."""

    def __init__(self, name: str, spec: Path):
        if name == "tokenmill":
            cmd = [sys.executable, "-m", "tokenmill.bench", str(spec)]
        else:
            cmd = [sys.executable, "-m", "tokenmill.bench.peers", name, str(spec)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.last_line = ""

    def read(self) -> dict:
        """The next reply; the log lines before it are echoed to stderr."""
        for line in self.proc.stdout:
            text, found, message = line.partition(REPLY)  # a progress bar may precede it
            sys.stderr.write(text if found else line)
            self.last_line = text.strip() or self.last_line
            if found:
                return json.loads(message)
        status = self.proc.wait()
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        raise WorkerError(f"{how}: {self.last_line}" if self.last_line else how)

    def call(self, command: str) -> dict:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # read() says how it died
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Engines:
    """The engines' workers, loaded one after another and measured side by side. `raw`
    collects each engine's facts and raw times; an engine whose worker dies is marked
    failed and the others go on."""

    def __init__(self, names: list[str], spec: Path):
        self.workers: dict[str, Worker] = {}
        self.raw: dict[str, dict] = {}
        for name in names:
            log(f"loading {name}")
            self.workers[name] = Worker(name, spec)
            info = self._ask(name, None)
            if info is not None:
                self.raw[name] = {"status": "ok", **info}

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        for worker in self.workers.values():
            worker.close()

    def _ask(self, name: str, command: str | None) -> dict | None:
        """The worker's reply to `command` (None: its next reply), or None if it is gone."""
        worker = self.workers.get(name)
        if worker is None:
            return None
        try:
            return worker.read() if command is None else worker.call(command)
        except WorkerError as e:
            worker.close()
            del self.workers[name]
            self.raw[name] = {"status": "failed", "reason": str(e)}
            log(f"{name} failed: {e}")
            return None

    def latency(
        self,
        prompt_lens: list[str],
        runs: int,
        progress=None,
        done: dict[str, int] | None = None,
        rounds: int | None = None,
    ) -> None:
        """Per P, a warm-up round and then `runs` rounds. Each round runs every engine once,
        in an order rotated from round to round. `done`: {P: rounds already run} (the
        warm-up is round 0); `rounds`: run at most this many rounds per P here.
        `progress`: a RunProgress told of each run."""
        for p in prompt_lens:
            first = (done or {}).get(p, 0)
            last = runs if rounds is None else min(runs, first + rounds - 1)
            for r in range(first, last + 1):
                names = list(self.workers)
                k = r % max(1, len(names))
                for name in names[k:] + names[:k]:
                    if progress is not None:
                        what = "warm-up" if r == 0 else f"run {r}/{runs}"
                        progress.begin(f"{name} latency @{p} {what}")
                    time.sleep(SETTLE_S)
                    sample = self._ask(name, f"latency {p}")
                    if progress is not None:
                        progress.done(name, "latency", p)
                    if sample is None or r == 0:
                        continue
                    self.raw[name].setdefault("latency", {}).setdefault(p, []).append(sample)
                    decode = (sample["output_tokens"] - 1) / sample["decode_s"]
                    log(
                        f"{name} P={p} run {r}/{runs}: TTFT {sample['ttft_s'] * 1e3:.0f} ms, "
                        f"decode {decode:.1f} tok/s"
                    )

    def calibrate(self) -> None:
        """Each engine's calibration batch (estimate.py), run twice: the first run is cold
        (an engine's first batched step can take many times a warm one), the second is
        kept as raw[engine]["calibration"]."""
        for name in list(self.workers):
            if self._ask(name, "calibrate") is not None:
                result = self._ask(name, "calibrate")
                if result is not None:
                    self.raw[name]["calibration"] = result

    def throughput(self, progress=None) -> None:
        for name in list(self.workers):
            log(f"{name}: throughput")
            if progress is not None:
                progress.begin(f"{name} throughput")
            result = self._ask(name, "throughput")
            if progress is not None:
                progress.done(name, "throughput")
            if result is not None:
                self.raw[name]["throughput"] = result
                log(f"{name}: throughput took {result['wall_s']:.1f} s")

    def finish(self) -> dict[str, dict]:
        """Each worker's peak RSS, then the raw results of all engines."""
        for name in list(self.workers):
            result = self._ask(name, "exit")
            if result is not None:
                self.raw[name].update(result)
        return self.raw
