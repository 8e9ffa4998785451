"""The CPU thread count, chosen by measuring steps: every core on a quiet machine, fewer on a busy one.

A step's parallel regions end at barriers. When another process keeps a core busy, the OS
deschedules one of the step's threads and every barrier waits for it, so a fixed count is either
slow on a busy machine or wasteful on a quiet one (measured in docs/performance.md): the engine
measures.

Every `TRIAL_PERIOD` steps a trial runs the current count and its neighbours (one fewer, one
more up to the ceiling) for `TRIAL_STEPS` steps each, interleaved (`DECISIVE_STEPS` each when by
then one count's slowest step was faster than every other count's fastest), on steps of about one size
(a step more than `SIMILAR_TOKENS` times larger or smaller than the trial's first starts the
trial again: a prefill chunk costs far less per token than a decode step), and keeps the count
with the least median seconds per scheduled token. While trials keep the count, the period
doubles (trials cost a few steps at a worse count), up to `MAX_TRIAL_PERIOD`. The first trial
starts after `FIRST_TRIAL_STEP` steps.

A step that takes `SLOWDOWN` times the seconds per token of the chosen count's steps in the
last trial (a step of about that trial's size) starts a trial at once: load that arrives in a
long job must not wait out a period grown to `MAX_TRIAL_PERIOD` steps.

Where the OS says how busy each CPU is (`OtherLoad`, Linux), the count is also capped at the
cores other processes leave free, read every `other_load.WINDOW_S` seconds while the engine
has work (a core counts as taken once others keep it `BUSY_CORE` busy; the time the engine was
idle, when others' work is no competition, is left out): a changed cap becomes the count at
once, and the next trial comes early. Trials find a busy core only on small steps, and a
prefill-heavy run has few.

Only steps of at most `TRIAL_MAX_TOKENS` tokens are trial steps; larger ones run at the chosen
count. A trial costs its steps' time at a worse count, which on a large prefill step is a large
share of a run; and a large step is where a busy core hurts least: its few barriers each wait
on a long share of work.

Invariants:
- The count stays within 1 .. the ceiling: `max_threads`, torch's count when the tuner was
  made (``OMP_NUM_THREADS`` or ``torch.set_num_threads`` set it), or fewer, the cores other
  processes leave free. torch has a count other than `max_threads` only while the engine has
  work (`release` when it has none); a change costs ~0.1 ms, so it is made only when the count
  changes.
- Only the thread count changes. In float32 tokens do not depend on it: torch's and oneDNN's
  CPU kernels split work by rows and columns, not by the reduced dimension, and the attention
  kernels give each (sequence, head) to one thread. In bfloat16 oneDNN's AMX GEMM blocks some
  prefill products' sums differently at one thread, so bf16 greedy tokens may differ between a
  quiet run and a loaded one.
"""

from __future__ import annotations

import statistics

import torch

from batchgen.engine.other_load import OtherLoad

TRIAL_PERIOD = 64  # steps at the chosen count after a trial that changed it
MAX_TRIAL_PERIOD = 1024  # the period doubles up to this while trials keep the count
TRIAL_STEPS = 4  # decode steps per candidate count in a trial
DECISIVE_STEPS = 2  # ...unless, after this many each, one count's slowest step beat every other's fastest
FIRST_TRIAL_STEP = 8  # the first steps meet each kernel and shape for the first time: not a fair trial
TRIAL_MAX_TOKENS = 512  # larger steps are never trial steps
SIMILAR_TOKENS = 1.3  # steps whose token counts differ by less than this factor compare in a trial
SLOWDOWN = 2.0  # a step this many times slower per token than the last trial's chosen steps starts a trial
BUSY_CORE = 0.4  # the share of a core others keep busy from which that core counts as taken


class ThreadTuner:
    def __init__(self, load: OtherLoad | None) -> None:
        self.max_threads = torch.get_num_threads()
        self.ceiling = self.max_threads  # the most threads: max_threads, or the cores others leave free
        self.num_threads = self.max_threads
        self._load = load
        self._is_idle = True  # no step yet, or `release` ran: the next step starts a load reading afresh
        self._steps_to_trial = FIRST_TRIAL_STEP
        self._period = TRIAL_PERIOD // 2  # the first trial that keeps the count doubles it to TRIAL_PERIOD
        self._trial: list[int] = []  # the counts of the trial's steps still to run, in order
        self._seconds_per_token: dict[int, list[float]] = {}
        self._trial_tokens = 0  # the scheduled tokens of the trial's first step
        self._is_trial_step = False  # whether the step `start_step` set up is one of the trial's
        self._reference: tuple[int, float] | None = None  # last trial's tokens, its chosen count's s per token

    def start_step(self, num_tokens: int) -> None:
        """Set torch's thread count for the next step, of `num_tokens` scheduled tokens: a trial's
        candidate, or the chosen count. A trial compares steps of about one size: a step more than
        `SIMILAR_TOKENS` times larger or smaller than the trial's first starts the trial again; a
        step of more than `TRIAL_MAX_TOKENS` runs at the chosen count and leaves the trial as it is."""
        self._is_trial_step = False
        self._follow_load()
        if num_tokens <= TRIAL_MAX_TOKENS:
            due = not self._trial and self._steps_to_trial == 0 and self.ceiling > 1
            if due or (self._trial and not _similar(num_tokens, self._trial_tokens)):
                others = {max(1, self.num_threads - 1), min(self.ceiling, self.num_threads + 1)} - {self.num_threads}
                candidates = [self.num_threads, *sorted(others)]  # the chosen count first: a restart costs nothing
                self._trial = candidates * TRIAL_STEPS
                self._trial_tokens = num_tokens
                self._seconds_per_token = {count: [] for count in candidates}
            self._is_trial_step = bool(self._trial)
        threads = self._trial[0] if self._is_trial_step else self.num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _follow_load(self) -> None:
        """The ceiling set to the cores other processes leave free, when a new reading says so; a
        changed ceiling becomes the count, any trial is dropped and the next comes early."""
        if self._load is None:
            return
        if self._is_idle:
            self._load.restart()
            self._is_idle = False
            return
        busy = self._load.busy_cores()
        if busy is None:
            return
        ceiling = max(1, min(self.max_threads, self._load.num_cpus - int(busy + 1 - BUSY_CORE)))
        if ceiling != self.ceiling:
            self.ceiling = self.num_threads = ceiling
            self._trial, self._reference = [], None
            self._steps_to_trial, self._period = FIRST_TRIAL_STEP, TRIAL_PERIOD // 2

    def release(self) -> None:
        """Give torch its ceiling back (the engine is idle: code outside a run sees the count it set)."""
        self._is_idle = True
        if torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)

    def end_step(self, seconds: float, num_tokens: int) -> None:
        """Record the step that `start_step` set up: its wall time and scheduled tokens."""
        if not self._is_trial_step:
            self._steps_to_trial = 0 if self._is_slowed_down(seconds, num_tokens) else max(self._steps_to_trial - 1, 0)
            return
        self._seconds_per_token[self._trial.pop(0)].append(seconds / max(num_tokens, 1))
        if self._trial and self._is_decided():
            self._trial = []
        if not self._trial:
            chosen = min(self._seconds_per_token, key=lambda count: statistics.median(self._seconds_per_token[count]))
            self._period = min(2 * self._period, MAX_TRIAL_PERIOD) if chosen == self.num_threads else TRIAL_PERIOD
            self.num_threads = chosen
            self._steps_to_trial = self._period
            self._reference = (self._trial_tokens, statistics.median(self._seconds_per_token[chosen]))

    def _is_slowed_down(self, seconds: float, num_tokens: int) -> bool:
        """Whether a step of about the last trial's size took `SLOWDOWN` times its chosen count's
        seconds per token."""
        if self._reference is None or num_tokens > TRIAL_MAX_TOKENS:
            return False
        tokens, seconds_per_token = self._reference
        return _similar(num_tokens, tokens) and seconds > SLOWDOWN * seconds_per_token * max(num_tokens, 1)

    def _is_decided(self) -> bool:
        """Every count has run `DECISIVE_STEPS` trial steps, and one count's slowest of them was faster
        than every other count's fastest (that count also has the least median)."""
        timings = self._seconds_per_token
        if any(len(seconds) < DECISIVE_STEPS for seconds in timings.values()):
            return False
        return any(all(max(seconds) < min(other) for rival, other in timings.items() if rival != count)
                   for count, seconds in timings.items())


def _similar(num_tokens: int, reference: int) -> bool:
    return max(num_tokens, reference) <= SIMILAR_TOKENS * max(min(num_tokens, reference), 1)
