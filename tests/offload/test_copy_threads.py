"""kvtier's CPU copy threads run torch single-threaded, even inside vLLM's CPU worker, which
replaces ``torch.set_num_threads`` with a no-op once it has bound its OpenMP threads: a copy
thread left at the default started a second OpenMP team on the engine's cores, and the
engine's prefill ran ~2x slower while kvtier copied (``kvtier bench serve``, no-reuse)."""

from __future__ import annotations

import os

import pytest
import torch

from offload.streams import ThreadCopyStream


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every thread is single-threaded")
def test_copy_threads_stay_single_threaded_when_set_num_threads_is_a_no_op(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # as vLLM's CPU worker does
    caller = torch.get_num_threads()
    stream = ThreadCopyStream(threads=2)
    seen: list[int] = []
    try:
        stream.submit([lambda: seen.append(torch.get_num_threads())] * 2).wait()  # the pool
        stream.submit([lambda: seen.append(torch.get_num_threads())]).wait()  # the dispatcher
    finally:
        stream.close()
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == caller > 1  # the caller's threads untouched
