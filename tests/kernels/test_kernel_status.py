"""The one status enum of the C kernels: the header and Python agree, and each status reads as
the caller's answer."""

from __future__ import annotations

import re

import pytest

from batchgen.kernels.c_library import CSRC_DIR
from batchgen.kernels.kernel_status import MESSAGES, Status, check_status


def test_python_holds_the_headers_statuses():
    header = (CSRC_DIR / "status.h").read_text()
    declared = {name: int(value) for name, value in re.findall(r"STATUS_(\w+) = (\d+)", header)}
    assert declared == {status.name: status.value for status in Status}


def test_no_kernel_source_declares_statuses_of_its_own():
    for source in CSRC_DIR.glob("*.c"):
        assert not re.search(r"STATUS_\w+ =", source.read_text()), source.name


def test_ok_runs_unsupported_declines_and_the_rest_name_the_refusal():
    assert check_status("kernel", Status.OK) is True
    assert check_status("kernel", Status.UNSUPPORTED) is False
    for status in (Status.BAD_CONTEXT_LEN, Status.BAD_BLOCK_ID, Status.BAD_GROUP):
        with pytest.raises(ValueError, match=f"^kernel: {re.escape(MESSAGES[status])}$"):
            check_status("kernel", status)
    with pytest.raises(MemoryError, match="scratch memory"):
        check_status("kernel", Status.NO_MEMORY)
    with pytest.raises(ValueError, match="status 42"):
        check_status("kernel", 42)
