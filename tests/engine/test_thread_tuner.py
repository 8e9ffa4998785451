"""The thread tuner: every core while that is fastest, fewer while another process is busy; and
its reading of how busy other processes keep this process's CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from batchgen.engine import other_load
from batchgen.engine.other_load import OtherLoad
from batchgen.engine.thread_tuner import (DECISIVE_STEPS, FIRST_TRIAL_STEP, MAX_TRIAL_PERIOD, TRIAL_MAX_TOKENS,
                                          TRIAL_PERIOD, TRIAL_STEPS, ThreadTuner)
from tests.conftest import torch_threads


@pytest.fixture
def four_threads():
    with torch_threads(4):
        yield


def run_steps(tuner: ThreadTuner, num_steps: int, seconds_at: dict[int, float], sizes: tuple[int, ...] = (32,)
              ) -> list[int]:
    """Steps of `sizes` tokens in turn, whose seconds per token depend on the thread count; the counts they ran at."""
    counts = []
    for step in range(num_steps):
        num_tokens = sizes[step % len(sizes)]
        tuner.start_step(num_tokens)
        counts.append(torch.get_num_threads())
        tuner.end_step(seconds_at[counts[-1]] * num_tokens, num_tokens)
    return counts


def test_a_quiet_machine_keeps_every_thread(four_threads):
    tuner = ThreadTuner(None)
    counts = run_steps(tuner, 200, {3: 1.3, 4: 1.0})
    assert tuner.num_threads == 4 and counts[:FIRST_TRIAL_STEP] == [4] * FIRST_TRIAL_STEP
    assert counts.count(3) <= 8  # two trials in 200 steps, the period doubling after each


def test_a_busy_core_moves_it_down_one_thread_per_trial_and_back_when_the_load_goes(four_threads):
    tuner = ThreadTuner(None)
    busy = {1: 3.0, 2: 1.6, 3: 4.0, 4: 5.0}  # another process keeps two cores busy: 2 threads are best
    run_steps(tuner, FIRST_TRIAL_STEP + 12 + TRIAL_PERIOD + 12, busy)
    assert tuner.num_threads == 2
    run_steps(tuner, 4 * TRIAL_PERIOD, busy)
    assert tuner.num_threads == 2
    run_steps(tuner, 3 * MAX_TRIAL_PERIOD, {1: 3.0, 2: 1.6, 3: 1.2, 4: 1.0})  # quiet again
    assert tuner.num_threads == 4


def test_a_trial_compares_steps_of_one_size_only(four_threads):
    tuner = ThreadTuner(None)
    counts = run_steps(tuner, FIRST_TRIAL_STEP + 50, {3: 0.1, 4: 1.0}, sizes=(400, 32))
    assert set(counts) == {4} and tuner.num_threads == 4  # each step of the other size restarts the trial
    run_steps(tuner, 12, {3: 0.1, 4: 1.0}, sizes=(40, 36))  # close enough: the trial completes
    assert tuner.num_threads == 3


def test_steps_above_the_trial_size_run_at_the_chosen_count_and_leave_the_trial_going(four_threads):
    tuner = ThreadTuner(None)
    big = TRIAL_MAX_TOKENS + 1
    counts = run_steps(tuner, FIRST_TRIAL_STEP + 200, {3: 0.1, 4: 1.0}, sizes=(big,))
    assert set(counts) == {4} and tuner.num_threads == 4  # never a trial
    counts = run_steps(tuner, 16, {3: 0.1, 4: 1.0}, sizes=(big, 32))
    assert counts[1::2] == [4, 3, 4, 3] + [3] * 4  # the small steps: a trial of 4 and 3 threads, then 3
    assert counts[0::2] == [4] * 4 + [3] * 4  # the big steps: the chosen count, unchanged until the trial ends
    assert tuner.num_threads == 3


def test_a_decisive_trial_ends_early_and_a_close_one_runs_all_its_steps(four_threads):
    tuner = ThreadTuner(None)
    run_steps(tuner, FIRST_TRIAL_STEP, {4: 1.0})
    counts = run_steps(tuner, 2 * DECISIVE_STEPS + 2, {3: 1.5, 4: 1.0})
    assert counts == [4, 3] * DECISIVE_STEPS + [4, 4] and tuner.num_threads == 4  # every 3-thread step slower
    tuner = ThreadTuner(None)
    run_steps(tuner, FIRST_TRIAL_STEP, {4: 1.0})
    noisy = iter([1.0, 1.2, 1.3, 1.1] + [1.0, 1.5] * TRIAL_STEPS)  # 4, 3, 4, 3 threads, ...: the steps overlap
    counts = []
    for _ in range(2 * TRIAL_STEPS + 1):
        tuner.start_step(32)
        counts.append(torch.get_num_threads())
        tuner.end_step(next(noisy) * 32, 32)
    assert counts == [4, 3] * TRIAL_STEPS + [4] and tuner.num_threads == 4  # the medians decide


def test_release_gives_torch_its_count_back(four_threads):
    tuner = ThreadTuner(None)
    run_steps(tuner, FIRST_TRIAL_STEP + 12, {3: 1.0, 4: 2.0})
    assert tuner.num_threads == 3 and torch.get_num_threads() == 3
    tuner.release()
    assert torch.get_num_threads() == 4
    tuner.start_step(True)
    assert torch.get_num_threads() == 3


def test_steps_that_slow_down_start_a_trial_at_once(four_threads):
    tuner = ThreadTuner(None)
    quiet, busy = {3: 1.3, 4: 1.0}, {3: 1.1, 4: 2.5}
    run_steps(tuner, 1000, quiet)  # the period has grown past the steps left
    assert tuner.num_threads == 4
    counts = run_steps(tuner, 8, busy)
    assert counts[:2] == [4, 4] and 3 in counts[2:]  # the slow step makes the next one a trial's
    assert tuner.num_threads == 3
    counts = run_steps(tuner, 40, quiet, sizes=(100,))  # other sizes and faster steps start nothing
    assert counts == [3] * 40


def test_a_step_only_a_little_slower_starts_no_trial(four_threads):
    tuner = ThreadTuner(None)
    run_steps(tuner, 1000, {3: 1.3, 4: 1.0})
    assert run_steps(tuner, 20, {3: 1.3, 4: 1.9}) == [4] * 20  # longer contexts, say: under SLOWDOWN


class ScriptedLoad:
    """Readings of other processes' busy cores, one per step (None: no new reading yet)."""

    def __init__(self, num_cpus: int, readings: list[float | None]):
        self.num_cpus = num_cpus
        self.readings = iter(readings)
        self.num_restarts = 0

    def busy_cores(self) -> float | None:
        return next(self.readings, None)

    def restart(self) -> None:
        self.num_restarts += 1


def test_cores_others_keep_busy_cap_the_count_at_once(four_threads):
    readings = [0.1] + [None] * 99 + [1.2] + [None] * 9 + [2.5] + [None] * 9 + [0.2]
    tuner = ThreadTuner(ScriptedLoad(4, readings))
    # steps too large to trial; the first starts the first reading, which the second step takes
    counts = run_steps(tuner, 131, {1: 3.0, 2: 1.6, 3: 1.3, 4: 1.0}, sizes=(2048,))
    assert counts[:101] == [4] * 101  # 0.1 of a core busy: every core
    assert counts[101:111] == [3] * 10  # 1.2 cores: one taken
    assert counts[111:121] == [1] * 10  # 2.5 cores: three taken (BUSY_CORE)
    assert counts[121:] == [4] * 10  # quiet again


def test_a_capped_count_trials_only_below_the_cap(four_threads):
    tuner = ThreadTuner(ScriptedLoad(4, [2.0]))
    counts = run_steps(tuner, FIRST_TRIAL_STEP + 12, {1: 3.0, 2: 1.0, 3: 0.5, 4: 0.4})
    assert set(counts[1:]) == {1, 2} and tuner.num_threads == 2  # never 3 or 4 while others hold two cores


def test_a_spinning_process_reads_as_a_busy_core():
    load = OtherLoad.open()
    assert load is not None and load.busy_cores() is None  # too soon for a reading
    cpu = min(os.sched_getaffinity(0))
    spin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(other_load.WINDOW_S + 0.1)
        load.busy_cores()  # the window with the spinner starting
        time.sleep(other_load.WINDOW_S + 0.1)
        assert load.busy_cores() > 0.8
    finally:
        spinner.kill()
        spinner.wait()


def test_a_run_after_an_idle_engine_reads_the_load_afresh(four_threads):
    load = ScriptedLoad(4, [2.5, 0.1])
    tuner = ThreadTuner(load)
    assert run_steps(tuner, 2, {1: 1.0, 4: 1.0}) == [4, 1]  # a first reading, then others hold three cores
    tuner.release()
    # the run's first step starts a new reading (the idle time is left out); the next reads 0.1
    assert run_steps(tuner, 2, {1: 1.0, 4: 1.0}) == [1, 4] and load.num_restarts == 2
