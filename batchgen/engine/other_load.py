"""How many of this process's CPUs other processes keep busy, read from Linux's /proc/stat.

The thread tuner's trials find a busy core only on steps small enough to trial, and only when
a trial is due; a prefill-heavy job on a busy machine may run for minutes before one is. The
OS counts every CPU's busy time, so the cores others take can be read directly: each CPU's busy
time (user, nice, system, irq, softirq and steal: a VM's vCPU taken by the host is as busy for
us) summed over the CPUs this process may run on, less this process's own CPU time.

Invariants:
- `OtherLoad.open()` is None where /proc/stat cannot be read (not Linux): callers then go on
  without it.
- `busy_cores()` answers only once `WINDOW_S` seconds have passed since its last answer or
  `restart()` (the counters tick every 10 ms), else None; an answer covers exactly that
  interval.
"""

from __future__ import annotations

import os
import time

STAT_PATH = "/proc/stat"
WINDOW_S = 0.5  # seconds a reading covers at least
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (idle 3 and iowait 4 are not busy)


class OtherLoad:
    def __init__(self, cpus: set[int]):
        self.num_cpus = len(cpus)
        self._names = {f"cpu{cpu}" for cpu in cpus}
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self._last = self._sample()

    @classmethod
    def open(cls) -> OtherLoad | None:
        """A reader for the CPUs this process may run on, or None where /proc/stat is unreadable."""
        try:
            return cls(os.sched_getaffinity(0))
        except (OSError, AttributeError, ValueError):
            return None

    def _sample(self) -> tuple[float, float]:
        """(wall seconds, the CPUs' busy seconds less this process's CPU seconds)."""
        wall, own = time.monotonic(), time.process_time()
        busy_ticks = 0
        with open(STAT_PATH) as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] in self._names:
                    values = [int(value) for value in fields[1:]]
                    busy_ticks += sum(values[i] for i in BUSY_FIELDS if i < len(values))
        return wall, busy_ticks * self._tick_s - own

    def restart(self) -> None:
        """Leave out the time since the last answer: the next covers only what comes after."""
        try:
            self._last = self._sample()
        except OSError:
            pass

    def busy_cores(self) -> float | None:
        """The cores other processes kept busy since the last answer (0 on a quiet machine, 1.0
        for one process spinning a core), once `WINDOW_S` has passed; else None."""
        wall = time.monotonic()
        if wall - self._last[0] < WINDOW_S:
            return None
        try:
            sample = self._sample()
        except OSError:
            return None
        (last_wall, last_others), self._last = self._last, sample
        return max(0.0, (sample[1] - last_others) / (sample[0] - last_wall))
