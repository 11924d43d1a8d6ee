"""The hang watchdog: a watched phase without progress for the timeout is reported, naming the rank that is
elsewhere and what it does, by the lowest rank alone; progress (collectives issued) and unwatched phases
(checkpoint writes) are never reported."""

import threading
import time

from tests.world import run_world


def _stalls(rank, world_size):
    from parallel.comm_stats import CommStats
    from parallel.watchdog import HangWatchdog

    reports, reported = [], threading.Event()

    def on_stall(who, says):
        reports.append((who, says))
        reported.set()
    stats = CommStats()
    watchdog = HangWatchdog(2.0, on_stall, beat_s=0.5)
    watchdog.follow(stats)
    # progress keeps it quiet: a collective issued every half second for 4 s, then an unwatched phase
    watchdog.at(1, "forward-backward")
    for _ in range(8):
        stats.add("all_reduce", "dp", 4.0)
        time.sleep(0.5)
    watchdog.at(1, "checkpoint save", watched=False)
    time.sleep(4)
    quiet = not reports
    # rank 0 waits in a step while rank 1 evaluates, both without progress: each reports the other
    watchdog.at(2, "forward-backward" if rank == 0 else "evaluation")
    assert reported.wait(30)
    # rank 0's process holds the store rank 1 reads rank 0's phase from: none leaves before both reported
    # (a loaded machine can delay one report by seconds)
    __import__("torch").distributed.barrier()
    watchdog.stop()
    return quiet, reports


def test_a_stalled_phase_is_reported_naming_the_rank_elsewhere_and_progress_is_not():
    (quiet0, [(who0, says0)]), (quiet1, [(who1, says1)]) = run_world(2, _stalls)
    assert quiet0 and quiet1
    assert who0.startswith("rank 1 (pid ") and " did not arrive (last heard " in who0, who0
    assert who0.endswith("at iteration 2, evaluation, last collective all_reduce over dp)"), who0
    assert who1.startswith("rank 0 (pid ") and "at iteration 2, forward-backward" in who1, who1
    assert says0 and not says1  # the lowest rank says it
