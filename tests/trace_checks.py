"""Checks of a trace written by ``Report.save_trace``, shared by the one- and two-process tests."""

from __future__ import annotations

STEP_BOUND_US = 120e6  # no event of one compiled step lies 2 minutes after its start


def check_trace(events: list[dict], measured: bool) -> dict[str, int]:
    """Assert the trace's invariants; return process name -> pid."""
    assert events
    assert all(isinstance(e["pid"], int) for e in events), {e["pid"] for e in events if not isinstance(e["pid"], int)}
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {e["pid"] for e in events} <= set(names), "every process is named"
    pids = {name: pid for pid, name in names.items()}
    assert len(pids) == len(names), "process names are unique"
    for graph in ("forward", "backward"):
        process = pids[f"estimated {graph}"]
        threads = {
            e["tid"]: e["args"]["name"]
            for e in events
            if e["pid"] == process and e["ph"] == "M" and e["name"] == "thread_name"
        }
        assert sorted(threads.values()) == ["comm", "compute"]
        spans = [e for e in events if e["pid"] == process and e["ph"] == "X"]
        assert spans and all(e["tid"] in threads and e["dur"] >= 0 for e in spans)
        counters = {e["name"] for e in events if e["pid"] == process and e["ph"] == "C"}
        assert counters == {"estimated live bytes", "bytes in flight"}
        assert all(
            isinstance(e["args"]["bytes"], int) and e["args"]["bytes"] >= 0
            for e in events
            if e["pid"] == process and e["ph"] == "C"
        )
        assert (
            max(e["args"]["bytes"] for e in events if e["pid"] == process and e["name"] == "estimated live bytes") > 0
        )
    # one time origin: the estimated step and the measured one both start at 0
    forward = [e["ts"] for e in events if e["pid"] == pids["estimated forward"] and e["ph"] == "X"]
    backward = [e["ts"] for e in events if e["pid"] == pids["estimated backward"] and e["ph"] == "X"]
    assert min(forward) == 0 and min(backward) >= max(forward)
    timed = [e for e in events if e["ph"] != "M"]
    assert all(0 <= e["ts"] < STEP_BOUND_US for e in timed), (min(e["ts"] for e in timed), max(e["ts"] for e in timed))
    measured_events = [e for e in timed if names[e["pid"]].startswith("measured")]
    assert bool(measured_events) == measured
    if measured:
        assert min(e["ts"] for e in measured_events) == 0
    return pids
