#!/usr/bin/env python3
"""Where the seesaw MLA decode kernel's time goes, from its clock stamps.

Run a decode with MOELINK_MLA_DECODE_SEESAW_TRACE=<prefix> (the kernel's
first three eager launches run stamped and write <prefix>.<n>.bin; see
SeesawTrace in src/attention/cuda/mla_decode_seesaw.cu), then:

    python3 tools/bench/seesaw_trace_report.py <prefix> [--clock-mhz 1980]

For each file and warpgroup: the median over blocks and pairs of stages
(the first and the last two pairs left out: pipeline fill and drain) of
each event's offset from warpgroup 0's pair start, in time order, with the
step from the event before it. Cycles are the SM clock; --clock-mhz turns
them into microseconds.
"""
import argparse
import glob
import sys

import numpy as np

# SeesawTrace's layout: [kBlocks][kPairs][2 warpgroups][kEvents] uint64 clock64 values.
BLOCKS, PAIRS = 16, 48
EVENTS = ["pair start", "own group landed", "other group landed", "scores done", "exchange",
          "own P V issued", "own P V done", "other P V issued", "other P V done"]
EXCHANGE = {0: "exchange (m1, P1 ready)", 1: "exchange (m0 ready)"}


def report(path, mhz, out=sys.stdout):
    stamps = np.fromfile(path, dtype=np.uint64).astype(np.int64)
    if stamps.size != BLOCKS * PAIRS * 2 * len(EVENTS):
        raise SystemExit(f"{path}: {stamps.size} stamps, expected {BLOCKS * PAIRS * 2 * len(EVENTS)} "
                         "(does SeesawTrace's layout match this script?)")
    stamps = stamps.reshape(BLOCKS, PAIRS, 2, len(EVENTS))
    print(f"== {path}", file=out)
    for wg in (0, 1):
        rows = []
        for b in range(BLOCKS):
            for p in range(1, PAIRS - 2):
                t, nxt = stamps[b, p, wg], stamps[b, p + 1, 0, 0]
                if (t == 0).any() or nxt == 0 or stamps[b, p, 0, 0] == 0:
                    continue  # a pair past the block's keys
                rows.append(np.append(t, nxt) - stamps[b, p, 0, 0])
        if not rows:
            print(f" wg{wg}: no complete pairs", file=out)
            continue
        med = np.median(np.array(rows), axis=0)
        names = [EXCHANGE[wg] if n == "exchange" else n for n in EVENTS] + ["next pair start (wg 0)"]
        print(f" warpgroup {wg} ({len(rows)} pairs): median cycles from wg 0's pair start", file=out)
        prev = None
        for i in np.argsort(med, kind="stable"):
            step = med[i] - prev if prev is not None else med[i]
            print(f"   {names[i]:26s} {med[i]:8.0f}   +{step:6.0f} ({step / mhz:.3f} us)", file=out)
            prev = med[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="MOELINK_MLA_DECODE_SEESAW_TRACE's value")
    ap.add_argument("--clock-mhz", type=float, default=1980.0, help="the SM clock (nvidia-smi clocks.sm)")
    args = ap.parse_args()
    files = sorted(glob.glob(args.prefix + ".*.bin"))
    if not files:
        raise SystemExit(f"no {args.prefix}.*.bin files")
    for f in files:
        report(f, args.clock_mhz)


if __name__ == "__main__":
    main()
