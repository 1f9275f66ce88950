/* How many threads each parallel region gets: all that were asked for, less the ones a
 * recent region had to wait for (tm_team, tm_team_done in tm.h).
 *
 * Why: an OpenMP region ends at a barrier, so it lasts as long as its slowest thread.
 * Beside a process that keeps one core busy, the OS deschedules one of two decode
 * threads for a whole time slice (1.5-3 ms) about every other slice, and the ~150
 * regions of a decode step (5 per layer, ~20 us each on the default model) each wait
 * for it: decode fell from 290 to 85-99 tok/s on 2 threads, below the 165-170 of one
 * thread beside the same busy core (issue 21, item 16; benchmarks/contention.py).
 *
 * What: each region's master thread notes when it finished its own share; if it then
 * waited at the barrier longer than STALL_MIN and than STALL_SHARE of its own work, a
 * thread was stalled, and the next regions run with one thread less. After a cool-down
 * the full team is tried again (a probe); a stall within TRIAL of a probe doubles the
 * next cool-down (up to COOL_MAX), so beside a busy core the team stays small and
 * probes cost well under 1% of the time, while on a quiet machine a stray stall costs
 * one COOL_MIN of smaller teams. Quiet regions pay three clock reads (~25 ns each).
 *
 * The state is process-wide (every caller's regions share one OpenMP pool) and kept
 * with relaxed atomics: concurrent callers only make the heuristic coarser. */
#include <time.h>

#include "tm.h"

#define MS 1000000LL                 /* ns */
#define STALL_MIN (50 * 1000LL)      /* ns a master may wait at a barrier unjudged */
#define STALL_SHARE 4                /* ... and its work / STALL_SHARE */
#define GAP (1 * MS)                 /* a region this long after the last team's end may have
                                        to wake sleeping threads: not judged */
#define COOL_MIN (20 * MS)           /* the first cool-down of an episode */
#define COOL_MAX (1000 * MS)         /* the longest: how late a freed core is taken back */
#define TRIAL (200 * MS)             /* a stall this soon after a probe fails the probe */

#define LOAD(v) __atomic_load_n(&(v), __ATOMIC_RELAXED)
#define STORE(v, x) __atomic_store_n(&(v), (x), __ATOMIC_RELAXED)
#define BUMP(v) __atomic_fetch_add(&(v), 1, __ATOMIC_RELAXED)

static struct {
    int32_t adapt;   /* 0: teams are never shrunk (tm_team_adapt) */
    int32_t deficit; /* threads taken off every team until `until` */
    int64_t until, cool, probe_at, last_end; /* ns, CLOCK_MONOTONIC */
    int64_t regions, stalls, probes, failed, shrunk; /* counters for tm_team_stats */
} team = {1, 0, 0, COOL_MIN, -TRIAL, 0, 0, 0, 0, 0, 0};

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
        if (now >= LOAD(team.until)) { /* cooled down: probe with the whole team */
            STORE(team.deficit, 0);
            STORE(team.probe_at, now);
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
    const int64_t last = __atomic_exchange_n(&team.last_end, end, __ATOMIC_RELAXED);
    BUMP(team.regions);
    if (!LOAD(team.adapt) || start - last > GAP) return;
    const int64_t wait = end - master_done, work = master_done - start;
    if (wait < STALL_MIN || wait < work / STALL_SHARE) return;
    BUMP(team.stalls);
    int64_t cool = COOL_MIN;
    if (end - LOAD(team.probe_at) < TRIAL) { /* the probe failed: stay small for longer */
        cool = 2 * LOAD(team.cool);
        cool = cool > COOL_MAX ? COOL_MAX : cool;
        STORE(team.probe_at, -TRIAL); /* one failure per probe */
        BUMP(team.failed);
    }
    STORE(team.cool, cool);
    STORE(team.until, end + cool);
    /* one thread less than this region had, for this caller's count */
    icv_lower(__atomic_add_fetch(&team.deficit, 1, __ATOMIC_RELAXED));
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
    STORE(team.deficit, 0); /* and a fresh episode */
    STORE(team.cool, COOL_MIN);
    STORE(team.until, 0);
    STORE(team.probe_at, -TRIAL);
    STORE(team.last_end, 0);
    icv_requested(0, 0); /* this thread's OpenMP count as it was */
    return was;
}

/* out [8]: multi-thread regions, stalls seen, probes, failed probes, regions run with a
 * smaller team, the current deficit, the current cool-down (ns), whether teams adapt. */
void tm_team_stats(int64_t *out) {
    out[0] = LOAD(team.regions), out[1] = LOAD(team.stalls), out[2] = LOAD(team.probes);
    out[3] = LOAD(team.failed), out[4] = LOAD(team.shrunk), out[5] = LOAD(team.deficit);
    out[6] = LOAD(team.cool), out[7] = LOAD(team.adapt);
}
