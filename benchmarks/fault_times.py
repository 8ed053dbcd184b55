"""Seconds from an injected fault to each rank's end, per fault.

    PYTHONPATH=. python benchmarks/fault_times.py

Runs each scenario of tests/test_faults.py once (two spawned gloo ranks, the tiny GPT,
compiled except where the name says not) and prints, per rank, the seconds from the
fault to the rank's end and the line of what it raised (or, for a rank that aborted,
printed) that names the cause. docs/failures.md quotes its output.
"""

from __future__ import annotations

from tests import test_faults

CASES = [
    ("rank killed mid-step (zombie)", test_faults._dies_mid_step, (2, "kill")),
    ("rank killed mid-step (zombie), uncompiled", test_faults._dies_mid_step, (2, "kill", False)),
    ("rank raises mid-step", test_faults._dies_mid_step, (2, "raise")),
    ("rank raises while the others compile", test_faults._fails_while_the_others_compile, ("raise",)),
    ("rank killed while the others compile", test_faults._fails_while_the_others_compile, ("kill",)),
    ("one rank's batch changes", test_faults._batch_changes, (2,)),
    ("skip-batch after an exception", test_faults._skips_a_batch, (2,)),
]


def main() -> None:
    for name, scenario, args in CASES:
        run = test_faults._run(scenario, *args)
        print(name)
        for rank, (outcome, exited) in enumerate(zip(run.outcomes, run.exited)):
            ended = outcome.ended if outcome is not None else exited
            said = outcome.error if outcome is not None and outcome.error else run.stderr[rank]
            lines = said.strip().splitlines()
            cause = next((line for line in lines if "compshard:" in line or "mismatch" in line), lines[-1:] or [""])
            print(f"    rank {rank}: {ended - run.fault:5.1f} s  {''.join(cause)[:160]}", flush=True)


if __name__ == "__main__":
    main()
