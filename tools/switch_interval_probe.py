"""Why the spot session lowers the interpreter's switch interval: ``python -m tools.switch_interval_probe`` (CPU).

A loop like the rollout's in the tail (wait for the device, which releases the interpreter's lock, then a little
Python) runs alone, then next to a thread doing pure-Python work (the trainer's side), at several switch intervals.
After each wait the loop needs the lock back, and the other thread keeps it until its interval runs out: the loop's
step time grows toward the interval. Prints the loop's time per step for each setting.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time


def _busy(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += i * i


def _loop_ms(steps: int, wait_s: float, host_ops: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        time.sleep(wait_s)  # the device wait: the lock is released
        sum(range(host_ops))  # the host's per-step work
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.switch_interval_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="loop steps per setting")
    ap.add_argument("--wait-ms", type=float, default=1.0, help="the device wait per step, ms")
    ap.add_argument("--host-ops", type=int, default=200,
                    help="the loop's Python work per step: sum(range(N)) (more: a heavier host step)")
    ap.add_argument("--intervals", default="0.005,0.0005,0.0002,0.0001", help="switch intervals to try, seconds")
    args = ap.parse_args()
    before = sys.getswitchinterval()
    print(f"alone: {_loop_ms(args.steps, args.wait_ms / 1e3, args.host_ops):.2f} ms/step")
    try:
        for interval in (float(v) for v in args.intervals.split(",")):
            sys.setswitchinterval(interval)
            stop = threading.Event()
            other = threading.Thread(target=_busy, args=(stop,), daemon=True)
            other.start()
            print(f"next to a busy thread, switch interval {interval * 1e3:g} ms: "
                  f"{_loop_ms(args.steps, args.wait_ms / 1e3, args.host_ops):.2f} ms/step")
            stop.set()
            other.join()
    finally:
        sys.setswitchinterval(before)


if __name__ == "__main__":
    main()
