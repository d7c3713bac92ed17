#!/usr/bin/env python3
"""Prints the soak's samples (mpsr-soak's CSV) as the Markdown tables BENCHMARKS.md keeps: the
agent at 10, 30, 60, 90 and 120 minutes (or the last sample), each column's range over the run,
and the largest anonymous RSS of each 10-minute agent life (the soak restarts the agent every 10
minutes, so growth inside the process shows as a rising peak from life to life).

    python3 scripts/soak-table.py target/soak/soak.csv
"""
import csv
import sys

COLS = [  # (CSV column, heading, scale)
    ("rss_kib", "RSS MiB", 1 / 1024),
    ("rss_anon_kib", "anon RSS MiB", 1 / 1024),
    ("fds", "fds", 1),
    ("threads", "threads", 1),
    ("state_bytes", "state.json KiB", 1 / 1024),
    ("journal_bytes", "journal KiB", 1 / 1024),
    ("history_bytes", "history.json KiB", 1 / 1024),
    ("history_decisions", "decisions kept", 1),
    ("tasks", "tasks", 1),
    ("domains", "domains", 1),
    ("pending", "pending actions", 1),
    ("jobs_submitted", "jobs submitted", 1),
    ("faults", "faults", 1),
]


def fmt(v, scale):
    return f"{v * scale:.1f}" if scale != 1 else f"{v:.0f}"


def main(path):
    rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(open(path))]
    if not rows:
        sys.exit(f"{path}: no samples")
    cols = [c for c in COLS if c[0] in rows[0]]
    print("| minute | " + " | ".join(h for _, h, _ in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    last = rows[-1]["minute"]
    marks = [m for m in (10, 30, 60, 90, 120) if m <= last] + [last]
    for m in dict.fromkeys(marks):
        r = min(rows, key=lambda r: abs(r["minute"] - m))
        print(f"| {r['minute']:.1f} | " + " | ".join(fmt(r[c], s) for c, _, s in cols) + " |")
    rng = [f"{fmt(min(r[c] for r in rows), s)}–{fmt(max(r[c] for r in rows), s)}" for c, _, s in cols]
    print("| range | " + " | ".join(rng) + " |")
    if "rss_anon_kib" in rows[0]:
        print()
        print("| agent life (minutes) | largest anon RSS MiB | largest RSS MiB |")
        print("|---|---|---|")
        life = 0
        while life * 10 < last:
            part = [r for r in rows if life * 10 <= r["minute"] < (life + 1) * 10]
            if part:
                print(f"| {life * 10}–{(life + 1) * 10} | {max(r['rss_anon_kib'] for r in part) / 1024:.1f} "
                      f"| {max(r['rss_kib'] for r in part) / 1024:.1f} |")
            life += 1


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/soak/soak.csv")
