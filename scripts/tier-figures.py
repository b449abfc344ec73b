#!/usr/bin/env python3
"""Measures the shared tier's two figures with the release `kvsnap replay` and a redis-server it
starts on a free loopback port (stopped at the end):

  1. time to first token of a turn restored from the tier at 8k context, against recomputing it:
     a first process stores an 8k-token request, fresh processes then replay it (restored from
     the tier) and time it against their own run without cache;
  2. the tier's cost on a workload with no shared prefixes (nothing to restore, everything to
     write): total time of the cached run with --tier against without, alternating runs.

    scripts/tier-figures.py [--kvsnap build/release/tools/kvsnap] [--runs 3] [--timeout-ms 50]

Exits 1 when a figure misses its target (or no run restored the 8k turn), 0 when both meet it.
"""
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(rng, count):
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
                    for _ in range(count))


def write_workload(path, requests):
    with open(path, "w") as out:
        for request in requests:
            out.write(json.dumps(request) + "\n")


def replay(kvsnap, workload, tier, timeout_ms=50):
    command = [kvsnap, "replay", "--json", "--quiet", "--chart", "", workload]
    if tier:
        command += ["--tier", tier, "--tenant", "figures", "--tier-timeout-ms", str(timeout_ms)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def wait_for_redis(port, server, seconds=10.0):
    """Until the server answers PING (it may take a moment to bind), or it exits: an error."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"tier-figures: redis-server exited with status {server.returncode}")
        ping = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True,
                              text=True)
        if ping.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    sys.exit(f"tier-figures: redis-server on port {port} did not answer in {seconds:.0f} s")


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: need at least 1")
    return value


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvsnap", default="build/release/tools/kvsnap")
    parser.add_argument("--runs", type=positive, default=3)
    parser.add_argument("--timeout-ms", type=int, default=50,
                        help="the restoring runs' --tier-timeout-ms (the default's, 50)")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--loglevel", "warning"],
                              stdout=subprocess.DEVNULL)
    tier = f"redis://127.0.0.1:{port}"
    missed = []
    try:
        wait_for_redis(port, server)
        with tempfile.TemporaryDirectory(prefix="kvsnap-tier-figures-") as folder:
            missed = figures(args, port, tier, folder)
    finally:
        server.terminate()
        server.wait()
    for miss in missed:
        print(f"MISSED: {miss}")
    return 1 if missed else 0


def figures(args, port, tier, folder):
    """Both figures; returns what missed its target."""
    missed = []
    rng = random.Random(7)

    # 1. An 8k-token prompt: stored by one process, restored by fresh ones.
    long_path = os.path.join(folder, "8k.jsonl")
    message = words(rng, 1400)[:8150]
    write_workload(long_path, [{"id": "long", "max_tokens": 4,
                                "messages": [{"role": "user", "content": message}]}])
    first = replay(args.kvsnap, long_path, tier)
    print(f"8k: prompt {first['prompt_tokens']} tokens, stored "
          f"{first['tier']['bytes_written']} bytes")
    ratios = []
    for _ in range(args.runs):
        run = replay(args.kvsnap, long_path, tier, args.timeout_ms)
        request = run["per_request"][0]
        assert run["agree"], run
        if run["tier"]["hits"] != 1:
            print(f"  not restored: the lookup timed out ({run['tier']['timeouts']}) after "
                  f"{args.timeout_ms} ms")
            continue
        ratios.append(request["ttft_ms_uncached"] / request["ttft_ms_cached"])
        print(f"  restored {run['tier']['restored_tokens']} tokens from the tier: time to "
              f"first token {request['ttft_ms_cached']:.1f} ms, recomputed "
              f"{request['ttft_ms_uncached']:.1f} ms ({ratios[-1]:.1f}x)")
    if ratios:
        speed_up = statistics.median(ratios)
        print(f"8k: median speed-up {speed_up:.1f}x (target >= 5x)")
        if speed_up < 5:
            missed.append(f"8k: median speed-up {speed_up:.1f}x, target >= 5x")
    else:
        missed.append(f"8k: no run restored the turn from the tier ({args.runs} tried)")

    # 2. No shared prefixes: 16 unrelated requests of ~1000 tokens.
    unique_path = os.path.join(folder, "unique.jsonl")
    write_workload(unique_path, [
        {"id": f"u{i}", "max_tokens": 8,
         "messages": [{"role": "user", "content": f"{i:03d} " + words(rng, 170)[:1000]}]}
        for i in range(16)])
    with_tier, without, shares = [], [], []
    for _ in range(args.runs):
        subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], check=True,
                       capture_output=True)
        run = replay(args.kvsnap, unique_path, tier)
        assert run["tier"]["hits"] == 0 and run["agree"], run
        with_tier.append(run["seconds"]["cached"])
        without.append(replay(args.kvsnap, unique_path, "")["seconds"]["cached"])
        shares.append(run["tier"]["caller_seconds"] / run["seconds"]["cached"])
        print(f"  no shared prefixes: {with_tier[-1]:.2f} s with the tier, "
              f"{without[-1]:.2f} s without ({run['tier']['bytes_written']} bytes written, "
              f"{run['tier']['caller_seconds'] * 1e3:.1f} ms of it in requests' tier calls; "
              f"{run['tier']['store_errors']} store errors, "
              f"{run['tier']['dropped_batches']} dropped)")
    overhead = statistics.median(with_tier) / statistics.median(without) - 1
    print(f"no shared prefixes: tier overhead {100 * overhead:+.1f}% of total time "
          f"(medians of {args.runs}; target <= 3%)")
    print(f"no shared prefixes: the requests' tier calls (lookups, encoding writes) took "
          f"{100 * statistics.median(shares):.2f}% of the cached run's time")
    if overhead > 0.03:
        missed.append(f"no shared prefixes: tier overhead {100 * overhead:+.1f}%, target <= 3%")
    return missed


if __name__ == "__main__":
    sys.exit(main())
