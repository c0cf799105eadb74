"""Per-case results of a shared rank job: a case that raises is recorded with its traceback, so it fails only the
test that reads it, with its own message, while the job's other cases still report."""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import pytest
import torch


class CaseError:
    """What a case raised on one rank (picklable: the formatted traceback)."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return f"CaseError({self.message!r})"


def record(report: dict, name, fn, *args, **kwargs):
    """`report[name] = fn(*args, **kwargs)`, or a `CaseError` with the traceback when it raises."""
    try:
        report[name] = fn(*args, **kwargs)
    except Exception:  # recorded for the one test that reads this case
        report[name] = CaseError(traceback.format_exc())
    return report[name]


def case(reports: list[dict], name) -> list:
    """Every rank's value of case `name`; fails the calling test with the rank's traceback when the case raised."""
    values = [report[name] for report in reports]
    for rank, value in enumerate(values):
        if isinstance(value, CaseError):
            pytest.fail(f"rank {rank}: case {name!r} raised:\n{value.message}", pytrace=False)
    return values


@contextmanager
def one_thread():
    """One intra-op thread for a job (the stock references' tolerances were measured so), restored after: a pool's
    rank runs other jobs next."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
