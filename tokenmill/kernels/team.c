/* How many threads each parallel region gets: all that were asked for, less one while
 * the team spends more time waiting for a stalled thread than working (tm_team,
 * tm_team_done in tm.h).
 *
 * Why: an OpenMP region ends at a barrier, so it lasts as long as its slowest thread.
 * Beside a process that keeps one core busy, the OS deschedules one of two decode
 * threads for a whole time slice (1.5-3 ms) about every other slice, and the ~150
 * regions of a decode step (5 per layer, ~20 us each on the default model) each wait
 * for it: decode fell from 290 to 85-99 tok/s on 2 threads, below the 165-170 of one
 * thread beside the same busy core (benchmarks/contention.py).
 *
 * What: each region's master notes when it finished its own share (`work`) and how long
 * it then waited at the barrier (`wait`). Over a WINDOW of region time, nt threads beat
 * nt - 1 only while the wait stays below the work (each region then takes work + wait
 * against about 2 x work on one thread fewer, for 2 threads), so when the window's
 * wait exceeds SLOW_NUM / SLOW_DEN of its work the next regions run with one thread
 * less, for a cool-down; then the whole team is tried again (a probe). A slow window
 * within TRIAL of the probe doubles the cool-down (up to COOL_MAX), a TRIAL without one
 * halves it (down to COOL_MIN): beside a busy core the team stays small and the probes
 * cost ~1% (a window every 2 s), while a machine that only scatters keeps its team.
 * Quiet regions pay three clock reads (~25 ns each).
 *
 * The state is process-wide (every caller's regions share one OpenMP pool) and kept
 * with relaxed atomics: concurrent callers only make the heuristic coarser. */
#include <time.h>

#include "tm.h"

#define MS 1000000LL       /* ns */
#define WINDOW (10 * MS)   /* region time (work + wait) per decision: a few time slices */
#define SLOW_NUM 1         /* a window is slow when wait > work * SLOW_NUM / SLOW_DEN */
#define SLOW_DEN 1
#define GAP (1 * MS)       /* a region this long after the last team's end may have to wake
                              sleeping threads: not counted */
#define COOL_MIN (20 * MS) /* the shortest cool-down, and the first */
#define COOL_MAX (2000 * MS) /* the longest: how late a freed core is taken back */
#define TRIAL (200 * MS)   /* a probe passes only if no window is slow for this long: right
                              after a sleep the woken thread gets its core back for a while,
                              so a first good window is no proof */

#define LOAD(v) __atomic_load_n(&(v), __ATOMIC_RELAXED)
#define STORE(v, x) __atomic_store_n(&(v), (x), __ATOMIC_RELAXED)
#define ADD(v, x) __atomic_add_fetch(&(v), (x), __ATOMIC_RELAXED)
#define BUMP(v) ADD(v, 1)
#define SWAP(v, x) __atomic_exchange_n(&(v), (x), __ATOMIC_RELAXED)

static struct {
    int32_t adapt;   /* 0: teams are never shrunk (tm_team_adapt) */
    int32_t deficit; /* threads taken off every team until `until` */
    int64_t probe_at; /* when the whole team went on trial; 0: not on trial */
    int64_t until, cool, last_end; /* ns, CLOCK_MONOTONIC */
    int64_t wait, work;            /* ns in the current window */
    int64_t regions, slow, probes, failed, shrunk; /* counters for tm_team_stats */
} team = {1, 0, 0, 0, COOL_MIN, 0, 0, 0, 0, 0, 0, 0, 0};

int64_t tm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The calling thread's OpenMP thread count (nthreads-var: what torch.get_num_threads()
 * returns there, and what torch's own parallel regions use: ~20 per decode step on the
 * default model, over the 49152 logits and such) is lowered with the team, or those
 * regions would still wait for the stalled thread and keep it spinning. icv_full: the
 * count before this thread lowered it, icv_set: what it was lowered to, 0: not lowered.
 * A count set anew in between (torch.set_num_threads) is the caller's and stays. */
#ifdef _OPENMP
static __thread int icv_full, icv_set;
#endif

static void icv_lower(int deficit) {
#ifdef _OPENMP
    if (!icv_set || omp_get_max_threads() != icv_set) icv_full = omp_get_max_threads();
    icv_set = icv_full - deficit < 1 ? 1 : icv_full - deficit;
    omp_set_num_threads(icv_set);
#else
    (void)deficit;
#endif
}

/* The threads the caller meant by `requested` (its count before this thread's shrink),
 * restoring the thread's count once the team is whole again. */
static int icv_requested(int requested, int deficit) {
#ifdef _OPENMP
    const int set = icv_set;
    if (!set) return requested;
    if (omp_get_max_threads() != set) { /* set anew by the caller: theirs */
        icv_set = 0;
        return requested;
    }
    if (deficit == 0) {
        omp_set_num_threads(icv_full);
        icv_set = 0;
    }
    return requested == set || requested <= 0 ? icv_full : requested;
#else
    (void)deficit;
    return requested;
#endif
}

/* tm_team at time `now` (ns; < 0: read the clock, only when the team is shrunk). */
int tm_team_at(int requested, int useful, int64_t now) {
    int deficit = LOAD(team.deficit);
    if (deficit > 0) {
        now = now < 0 ? tm_now() : now;
        if (now >= LOAD(team.until)) { /* cooled down: the whole team, on trial */
            STORE(team.deficit, 0);
            STORE(team.probe_at, now);
            STORE(team.wait, 0);
            STORE(team.work, 0);
            BUMP(team.probes);
            deficit = 0;
        }
    }
    int nt = tm_threads(icv_requested(requested, deficit));
    if (nt > 1 && deficit > 0) {
        nt = nt - deficit < 1 ? 1 : nt - deficit;
        BUMP(team.shrunk);
    }
    return nt < useful ? nt : useful < 1 ? 1 : useful;
}

int tm_team(int requested, int useful) { return tm_team_at(requested, useful, -1); }

/* A region of nt threads started at `start`; its master finished its share at
 * `master_done` and left the barrier at `end` (ns). */
void tm_team_note(int nt, int64_t start, int64_t master_done, int64_t end) {
    if (nt <= 1) return;
    const int64_t last = SWAP(team.last_end, end);
    BUMP(team.regions);
    if (!LOAD(team.adapt) || start - last > GAP) return;
    const int64_t wait = ADD(team.wait, end - master_done), work = ADD(team.work, master_done - start);
    if (wait + work < WINDOW) return;
    STORE(team.wait, 0); /* the window is judged: a new one begins */
    STORE(team.work, 0);
    const int64_t probe_at = LOAD(team.probe_at);
    int64_t cool = LOAD(team.cool);
    if (wait * SLOW_DEN <= work * SLOW_NUM) { /* the team paid off */
        if (probe_at && end - probe_at >= TRIAL) { /* the probe passed its trial */
            STORE(team.probe_at, 0);
            STORE(team.cool, cool / 2 < COOL_MIN ? COOL_MIN : cool / 2);
        }
        return;
    }
    BUMP(team.slow);
    if (probe_at) { /* the probe failed: stay small for longer */
        STORE(team.probe_at, 0);
        cool = 2 * cool > COOL_MAX ? COOL_MAX : 2 * cool;
        STORE(team.cool, cool);
        BUMP(team.failed);
    }
    STORE(team.until, end + cool);
    /* one thread less than this region had, for this caller's count */
    icv_lower(ADD(team.deficit, 1));
}

void tm_team_done(int nt, int64_t start, int64_t master_done) {
    if (nt > 1) tm_team_note(nt, start, master_done, tm_now());
}

/* 0: every region gets the threads asked for (the fixed team, for comparisons); 1: the
 * adaptive team (the default). Either way the state starts afresh. Returns the previous
 * setting. */
int tm_team_adapt(int on) {
    const int was = LOAD(team.adapt);
    STORE(team.adapt, on ? 1 : 0);
    STORE(team.deficit, 0); /* and a fresh start */
    STORE(team.probe_at, 0);
    STORE(team.cool, COOL_MIN);
    STORE(team.until, 0);
    STORE(team.last_end, 0);
    STORE(team.wait, 0);
    STORE(team.work, 0);
    icv_requested(0, 0); /* this thread's OpenMP count as it was */
    return was;
}

/* out [8]: multi-thread regions, slow windows, probes, failed probes, regions run with a
 * smaller team, the current deficit, the current cool-down (ns), whether teams adapt. */
void tm_team_stats(int64_t *out) {
    out[0] = LOAD(team.regions), out[1] = LOAD(team.slow), out[2] = LOAD(team.probes);
    out[3] = LOAD(team.failed), out[4] = LOAD(team.shrunk), out[5] = LOAD(team.deficit);
    out[6] = LOAD(team.cool), out[7] = LOAD(team.adapt);
}
