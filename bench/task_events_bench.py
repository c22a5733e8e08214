"""What a per-step actor call's task event costs the GCS: why RankWorker.step and the aggregator's ingest and
wait_records are `@ray.method(enable_task_events=False)`.

    python bench/task_events_bench.py [--calls 30000]

Ray keeps every task's events in the GCS (up to task_events_max_num_task_in_gcs, 100,000 by default) for the
dashboard and the state API. Each rank's step is one task per iteration, so a long run fills that table: the
hour-long chaos soak saw the GCS server's RSS grow 135%. Prints the GCS server's RSS growth and the caller's
time for the same number of calls of one actor method with task events and of one without, in this process.
"""

import argparse
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import ray  # noqa: E402


class Echo:
    def tracked(self, x: int) -> int:
        return x

    @ray.method(enable_task_events=False)
    def untracked(self, x: int) -> int:
        return x


def gcs_rss() -> int:
    for p in psutil.process_iter(["cmdline"]):
        if "gcs_server" in " ".join(p.info["cmdline"] or []):
            return p.memory_info().rss
    raise RuntimeError("no gcs_server process")


def run(actor, method: str, calls: int) -> tuple[float, float]:
    before, t0 = gcs_rss(), time.perf_counter()
    for _ in range(0, calls, 500):  # 500 in flight at a time, as a few ranks' steps are
        ray.get([getattr(actor, method).remote(i) for i in range(500)])
    took = time.perf_counter() - t0
    time.sleep(3)  # the workers flush their task events to the GCS every second
    return (gcs_rss() - before) / 2**20, took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=30_000)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(Echo).remote()
    ray.get(actor.tracked.remote(0))
    off = run(actor, "untracked", args.calls)  # first: the GCS's own warm-up counts against it, not for it
    on = run(actor, "tracked", args.calls)
    print(f"{args.calls} calls with task events:    GCS RSS +{on[0]:.1f} MiB, {on[1]:.2f} s")
    print(f"{args.calls} calls without task events: GCS RSS +{off[0]:.1f} MiB, {off[1]:.2f} s")
    print(f"caller time without / with: {off[1] / on[1]:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
