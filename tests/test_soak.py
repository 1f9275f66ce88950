"""A short soak of a real `tokenmill serve` (SmolLM2-135M, on 127.0.0.1):
a minute of mixed streaming load with random aborts, bad requests and a full queue,
from benchmarks/soak.py (which runs the same load for as long as asked). Issue 11. After
40 s an attacker joins with the second attack run's requests: each must get
the status it deserves, and the server must not die.

After it: no 5xx on either side, every bad request a 4xx, the engine idle with zero KV
blocks held and nothing in flight, the server's request counters equal to what the
clients saw, and the server's RSS within a bound of its size after warm-up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from server_fixture import server_process

from tokenmill.sampling.grammar import CACHE_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from soak import Soak  # noqa: E402

pytestmark = pytest.mark.slow

SECONDS = 60
WARM_UP_S = 20
QUIET_S = 40  # legitimate load alone until then; then one attacker joins
RSS_GROWTH_BOUND = 64 << 20  # from warm-up to QUIET_S; the KV pool below is 32 MiB
# RSS under the attacks is not bounded here: it rose ~350 MiB in 20-40 s of them in one
# run (big bodies, 20k-entry grammars), the working memory of the attacks in flight.
# Once the load stops and the engine falls idle (it then gives freed heap back, tested in
# test_kv_resident.py), RSS must be back within 10% of where the attacks began, plus what
# the grammar cache may keep (its 64 MiB budget, an estimate: twice that is allowed). On
# this small server a CI run settled 98 MiB above (483 -> 581 MiB); the 1 GiB default
# server of benchmarks/soak.py settled at 1.016x.
SETTLE_S = 5.0


def test_short_soak(smollm_path):
    args = ("--kv-cache-memory", "32MiB", "--max-num-seqs", "6", "--max-waiting", "3")
    with server_process(*args) as server:
        soak = Soak(server.base_url, pid=server.pid, workers=8, seed=1, attackers=1,
                    quiet_s=QUIET_S, proc=server.proc, settle_s=SETTLE_S)  # fmt: skip
        report = soak.run(SECONDS, 2.0)
        log = server.log()
    statuses = report.by_status
    assert not report.errors, report.errors
    assert not [code for code in statuses if code.startswith("5")], statuses
    assert statuses["200"] > 50 and statuses["aborted"] > 5 and statuses["400"] > 5, statuses
    assert report.idle_after and not any(report.idle_after.values()), report.idle_after
    # the server's counts match the clients': aborted streams are its 499s, and it also
    # answered the /metrics reads made after the load
    server = {code: int(n) for code, n in report.server_by_code.items()}
    # (a stream the client cuts just after the server sent its last chunk is a 200 there, as
    # are the /metrics reads: every cut or finished request is counted, most cuts as 499s)
    cuts, done = server.get("499", 0), server.get("200", 0)
    assert statuses["aborted"] // 2 < cuts <= statuses["aborted"], (server, statuses)
    assert cuts + done >= statuses["aborted"] + statuses["200"], (server, statuses)
    for code, n in statuses.items():
        if code not in ("aborted", "200", "closed"):
            assert server.get(code, 0) == n, (code, server, statuses)
    warm = max(b for t, b in report.rss if t <= WARM_UP_S)
    peak = max(b for t, b in report.rss if WARM_UP_S < t <= QUIET_S)
    assert peak <= warm + RSS_GROWTH_BOUND, [(round(t), b >> 20) for t, b in report.rss]
    trail = " ".join(f"{t:.0f}s:{b >> 20}" for t, b in report.rss)
    bound = report.rss_at_attacks() * 1.10 + 2 * CACHE_BYTES
    assert report.rss_settled <= bound, f"{report.rss_settled >> 20} MiB; {trail}"
    assert "Traceback" not in log
