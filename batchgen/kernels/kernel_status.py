"""The status every C kernel returns (``csrc/status.h``), and what its caller makes of it.

Invariants:
- `Status` holds the header's values, name for name (a test reads the header).
- A kernel that returns UNSUPPORTED has written nothing: its caller runs another path. Every
  other status but OK names what the kernel refused, as the exception `check_status` raises.
"""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    OK = 0
    BAD_CONTEXT_LEN = 1
    BAD_BLOCK_ID = 2
    UNSUPPORTED = 3
    NO_MEMORY = 4
    BAD_GROUP = 5
    BAD_SLOT = 6


MESSAGES = {
    Status.BAD_CONTEXT_LEN: "a context length is < 1 or longer than the block table covers, or a query count is < 1 "
                            "or more than its context length",
    Status.BAD_BLOCK_ID: "a block table entry is outside [0, num_blocks)",
    Status.NO_MEMORY: "the kernel could not allocate its scratch memory",
    Status.BAD_GROUP: "a shared-prefix group is out of order or range, has one member, is not shorter than a "
                      "member's context (or a chunk's first query), or its members do not hold the same prefix blocks",
    Status.BAD_SLOT: "a slot is outside the pool",
}


def check_status(function: str, status: int) -> bool:
    """True for OK, False for UNSUPPORTED (nothing written); for any other status a ValueError
    (MemoryError for NO_MEMORY) naming `function` and what it refused."""
    if status == Status.OK:
        return True
    if status == Status.UNSUPPORTED:
        return False
    message = f"{function}: {MESSAGES.get(status, f'status {status}')}"
    raise MemoryError(message) if status == Status.NO_MEMORY else ValueError(message)
