#!/usr/bin/env python3
"""Report of a `profile.sh` recording: see profile.sh's header for the options."""
import argparse, collections, re, subprocess, sys

p = argparse.ArgumentParser()
p.add_argument("data")
p.add_argument("--from", dest="start", type=float)
p.add_argument("--to", dest="stop", type=float)
p.add_argument("--window", action="append", default=[], metavar="FROM:TO",
               help="a window (repeatable; the report covers their union)")
p.add_argument("--ops", type=float, help="operations in the window, for CPU-µs per op")
p.add_argument("--top-procs", type=int, default=3)
p.add_argument("--top-syms", type=int, default=15)
p.add_argument("--thread-syms", action="store_true",
               help="also the top symbols of each thread name of the top processes")
p.add_argument("--inclusive", metavar="REGEX",
               help="also the inclusive share (callees counted) of the symbols matching REGEX")
p.add_argument("--bin", type=float, default=1.0)
a = p.parse_args()
wins = [tuple(float(x) for x in w.split(":")) for w in a.window]
if a.start or a.stop:
    wins.append((a.start or 0.0, a.stop or 1e12))

def perf(*args):
    return subprocess.run(["perf", *args], capture_output=True, text=True, check=True).stdout

# Process names: the leader thread's comm (COMM events), else the commonest thread comm.
leader, comms = {}, collections.defaultdict(collections.Counter)
samples = []  # (time, pid, period_ns, thread comm, tid)
task = re.compile(r"PERF_RECORD_COMM(?: exec)?: (.*):(\d+)/(\d+)")
smp = re.compile(r"^\s*(.*?)\s+(-?\d+)/(-?\d+)\s+([\d.]+):\s+(\d+)\s")
for line in perf("script", "-i", a.data, "--show-task-events", "-F", "comm,pid,tid,time,period").splitlines():
    m = task.search(line)
    if m:
        if m[2] == m[3]:
            leader[int(m[2])] = m[1]
        continue
    m = smp.match(line)
    if not m:
        continue
    t, pid = float(m[4]), int(m[2])
    if wins and not any(lo <= t <= hi for lo, hi in wins):
        continue
    comms[pid][m[1]] += 1
    samples.append((t, pid, int(m[5]), m[1], int(m[3])))
if not samples:
    sys.exit("no samples in the window")

def name(pid):
    return "idle (swapper)" if pid == 0 else leader.get(pid) or comms[pid].most_common(1)[0][0]

t0, t1 = samples[0][0], samples[-1][0]
n = len(samples)
by = collections.Counter(); ns = collections.Counter(); pids = collections.defaultdict(set)
for t, pid, per, _, _ in samples:
    k = name(pid); by[k] += 1; ns[k] += per; pids[k].add(pid)
span = sum(hi - lo for lo, hi in wins) if wins and len(wins) > 1 else t1 - t0
print(f"\n== {a.data}: {n} samples, {t0:.3f} .. {t1:.3f} s monotonic ({span:.2f} s sampled)")
print(f"{'process':<20}{'samples':>9}{'share':>8}{'CPU-ms':>10}" + (f"{'CPU-µs/op':>11}" if a.ops else ""))
for k, c in by.most_common():
    if c / n < 0.005:
        continue
    row = f"{k[:19]:<20}{c:>9}{100 * c / n:>7.1f}%{ns[k] / 1e6:>10.0f}"
    if a.ops and k != "idle (swapper)":
        row += f"{ns[k] / 1e3 / a.ops:>11.1f}"
    print(row)

top = [k for k, _ in by.most_common() if k != "idle (swapper)"][: a.top_procs]
print(f"\n-- share of samples per {a.bin:g} s (start of bin, s from {t0:.3f})")
cols = top + ["idle (swapper)"]
print(f"{'t':>6} " + " ".join(f"{c[:14]:>14}" for c in cols) + f"{'other':>8}")
bins = collections.defaultdict(collections.Counter)
for t, pid, _, _, _ in samples:
    bins[int((t - t0) // a.bin)][name(pid)] += 1
for b in sorted(bins):
    tot = sum(bins[b].values())
    sh = [100 * bins[b][c] / tot for c in cols]
    print(f"{b * a.bin:>6.1f} " + " ".join(f"{s:>13.0f}%" for s in sh) + f"{100 - sum(sh):>7.0f}%")

for k in top:
    threads = collections.Counter(c for _, pid, _, c, _ in samples if name(pid) == k)
    tids = collections.defaultdict(collections.Counter)
    for _, pid, _, c, tid in samples:
        if name(pid) == k:
            tids[c][tid] += 1
    print(f"\n-- {k}: by thread name (threads; busiest thread), % of its samples: " + ", ".join(
        f"{c} {100 * v / by[k]:.0f}% ({len(tids[c])}; {100 * tids[c].most_common(1)[0][1] / by[k]:.0f}%)"
        for c, v in threads.most_common(6)))
    print(f"-- top symbols of {k} (self, % of its samples)")
    args = ["report", "-i", a.data, "--stdio", "--no-children", "-g", "none", "--sort", "dso,sym",
            "--percentage", "relative", "--pid", ",".join(map(str, sorted(pids[k])))]
    if wins:
        args += ["--time", " ".join(f"{lo:.6f},{hi:.6f}" for lo, hi in wins)]
    rows = [l for l in perf(*args).splitlines() if l.strip() and not l.startswith("#")]
    print("\n".join(rows[: a.top_syms]))
    if a.thread_syms:
        for c, v in threads.most_common(3):
            if v / by[k] >= 0.1:
                sub = [l for l in perf(*args, "--comm", c).splitlines() if l.strip() and not l.startswith("#")]
                print(f"   thread {c}:\n" + "\n".join(sub[: a.top_syms]))
    if a.inclusive:
        inc = [l for l in perf(*[x for x in args if x != "--no-children"], "--children").splitlines()
               if not l.startswith("#") and re.search(a.inclusive, l.split("] ", 1)[-1])]
        print(f"   inclusive (children, self, % of its samples):\n" + "\n".join(inc[: a.top_syms]))
    # Self time by crate (the first path segment that is not core/alloc/std), else by DSO.
    crates = collections.Counter()
    for l in rows:
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)", l)
        if not m:
            continue
        segs = [x for x in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)::", m[4]) if x not in ("core", "alloc", "std")]
        crates["kernel" if m[3] == "k" else segs[0] if segs else m[2]] += float(m[1])
    print("   by crate: " + ", ".join(f"{c} {v:.0f}%" for c, v in crates.most_common(10)))
