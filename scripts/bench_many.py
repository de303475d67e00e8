"""Many models in scripts/bench (issue 27, item 4): `scripts/bench --only many`.

N single-instance add/sub models (torchpool.examples.addsub_repository) in
one daemon, for a few and for many N (20 and 100; --quick: 5 and 20), one
daemon after the other: the seconds from starting `torchpool serve` to its
"torchpool ready" line, the daemon's PSS (Pss of /proc/<pid>/smaps_rollup,
summed over the broker and every process under it) by kind of process, and
the PSS each added model costs: the slope between the two N.

Where an idle worker's memory goes: the median worker's smaps_rollup beside
the fork server's it was forked from (Rss, Pss, shared and private pages),
and its largest mappings from /proc/<pid>/smaps by what they map: the heap
and anonymous memory (torch's and Python's allocations after the fork, the
pages of the fork server's heap it wrote to), the shared-memory segments of
its arenas, libraries.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.support.daemon import descendants  # noqa: E402

ROLLUP_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Shared_Clean", "Shared_Dirty",
                 "Private_Clean", "Private_Dirty", "Anonymous")


def rollup(pid: int) -> dict[str, int]:
    """/proc/<pid>/smaps_rollup's fields, in KiB ({} once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0])
    return out


def kinds(root: int) -> dict[int, str]:
    """broker, forkserver, worker or other for `root` (the broker) and every
    process under it: the fork server is the broker's child running
    multiprocessing's fork server (its title, with setproctitle), the
    workers are its children."""
    def read(pid: int, name: str) -> str:
        try:
            return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    parent = {pid: int(read(pid, "stat").rsplit(")", 1)[1].split()[1]) for pid in [root, *descendants(root)]
              if read(pid, "stat")}
    servers = {pid for pid, ppid in parent.items()
               if ppid == root and ("forkserver" in read(pid, "cmdline"))}
    return {pid: "broker" if pid == root else "forkserver" if pid in servers
            else "worker" if ppid in servers else "other" for pid, ppid in parent.items()}


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


SMAPS_FIELDS = ("Size", "Rss", "Pss", "Private_Dirty", "Private_Clean")


def smaps(pid: int) -> list[dict]:
    """/proc/<pid>/smaps: each mapping's `what` (its file, libraries by
    name, torchpool's memfd and /dev/shm segments together, [heap], [stack]
    or [anon]) and SMAPS_FIELDS in KiB."""
    out: list[dict] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if "-" in head[0] and not head[0].endswith(":"):      # range perms offset dev inode [path]
            path = head[5].strip() if len(head) > 5 else "[anon]"
            if path.startswith(("/dev/shm/", "/memfd:torchpool")):
                path = "torchpool's shared memory (memfd, /dev/shm)"
            elif path.startswith("/"):
                path = Path(path.split(" (deleted)")[0]).name
            out.append({"what": path, **{k: 0 for k in SMAPS_FIELDS}})
        elif out and head[0].rstrip(":") in SMAPS_FIELDS:
            out[-1][head[0].rstrip(":")] = int(head[1])
    return out


def grouped(maps: list[dict]) -> dict[str, dict[str, int]]:
    """The mappings summed by what they map, with their count."""
    groups: dict[str, dict[str, int]] = {}
    for m in maps:
        g = groups.setdefault(m["what"], {"count": 0, **{k: 0 for k in SMAPS_FIELDS}})
        g["count"] += 1
        for k in SMAPS_FIELDS:
            g[k] += m[k]
    return groups


def measure_daemon(work: Path, count: int, keep_worker: bool) -> dict:
    from bench import Daemon
    from torchpool.examples import addsub_repository

    repo = work / f"many{count}"
    addsub_repository(repo, count)
    daemon = Daemon(repo, [f"ipc://{work}/many{count}.sock"], work / f"many{count}.log")
    try:
        ready = daemon.wait_ready(600)
        processes = {pid: {"kind": k, **rollup(pid)} for pid, k in kinds(daemon.proc.pid).items()}
        processes = {pid: p for pid, p in processes.items() if "Pss" in p}
        out = {"models": count, "ready_s": ready, "processes": len(processes),
               "pss_total_kib": sum(p["Pss"] for p in processes.values()), "by_kind": {}}
        for name in ("broker", "forkserver", "worker", "other"):
            mine = [p for p in processes.values() if p["kind"] == name]
            if mine:
                out["by_kind"][name] = {"count": len(mine), "pss_kib": sum(p["Pss"] for p in mine),
                                        "median_pss_kib": statistics.median(p["Pss"] for p in mine)}
        if keep_worker:
            out["breakdown"] = breakdown(processes)
    finally:
        daemon.stop()
    return out


def breakdown(processes: dict[int, dict]) -> dict:
    """The median worker (by Pss), the fork server and the broker: rollups,
    threads, largest mappings."""
    workers = sorted((p["Pss"], pid) for pid, p in processes.items() if p["kind"] == "worker")
    worker = workers[len(workers) // 2][1]
    server = next(pid for pid, p in processes.items() if p["kind"] == "forkserver")
    broker = next(pid for pid, p in processes.items() if p["kind"] == "broker")
    out = {}
    for name, pid in (("worker", worker), ("forkserver", server), ("broker", broker)):
        maps = smaps(pid)
        out[name] = {"rollup": {k: processes[pid].get(k, 0) for k in ROLLUP_FIELDS}, "threads": threads(pid),
                     "mappings": grouped(maps),
                     "largest_private": sorted(maps, key=lambda m: -m["Private_Dirty"])[:8]}
    return out


def bench_many(quick: bool = False) -> dict:
    few, many = (5, 20) if quick else (20, 100)
    with tempfile.TemporaryDirectory(prefix="torchpool-bench-many-") as tmp:
        work = Path(tmp)
        runs = []
        for count in (few, many):
            print(f"many models: {count} single-instance add/sub models ...", flush=True)
            runs.append(measure_daemon(work, count, keep_worker=count == many))
    slope = (runs[1]["pss_total_kib"] - runs[0]["pss_total_kib"]) / (many - few)
    return {"runs": runs, "pss_per_model_kib": slope}


# ------------------------------------------------------------------ report

def mib(kib: float) -> str:
    return f"{kib / 1024:,.1f} MiB"


def render_many(r: dict) -> list[str]:
    runs = r["runs"]
    lines = ["", "many models (bench_many.py): N single-instance add/sub models in one daemon, idle; "
                 "PSS from /proc/*/smaps_rollup:", "",
             "| models | ready in | processes | PSS in all | broker | fork server | workers (median each) | other |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        k = run["by_kind"]

        def cell(name: str) -> str:
            return mib(k[name]["pss_kib"]) if name in k else "-"

        workers = k.get("worker", {"pss_kib": 0, "median_pss_kib": 0, "count": 0})
        lines.append(f"| {run['models']} | {run['ready_s']:.1f} s | {run['processes']} | {mib(run['pss_total_kib'])} "
                     f"| {cell('broker')} | {cell('forkserver')} | {mib(workers['pss_kib'])} "
                     f"({workers['count']} x {mib(workers['median_pss_kib'])}) | {cell('other')} |")
    many = runs[-1]
    lines += ["", f"PSS per added model: {mib(r['pss_per_model_kib'])} = {r['pss_per_model_kib'] * 1024 / 1e6:.1f} MB "
                  f"({runs[0]['models']} -> {many['models']} models); goals: {many['models']} models ready <= 20 s "
                  f"({'met' if many['ready_s'] <= 20 else '**missed**'}, {many['ready_s']:.1f} s), "
                  f"<= 15 MB per added idle model "
                  f"({'met' if r['pss_per_model_kib'] * 1024 <= 15e6 else '**missed**'})"]
    if "breakdown" in many:
        lines += render_breakdown(many["breakdown"])
    return lines


def render_breakdown(b: dict) -> list[str]:
    w, s = b["worker"], b["forkserver"]
    lines = ["", f"one idle worker (the median) beside the fork server it was forked from "
                 f"({w['threads']} and {s['threads']} threads):", "",
             "| KiB | " + " | ".join(ROLLUP_FIELDS) + " |", "|---|" + "---|" * len(ROLLUP_FIELDS)]
    for name, row in (("worker", w), ("fork server", s)):
        lines.append(f"| {name} | " + " | ".join(f"{row['rollup'][k]:,}" for k in ROLLUP_FIELDS) + " |")
    lines += ["", "the worker's largest mappings by PSS (KiB; private = Private_Dirty + Private_Clean), "
                  "the fork server's beside them:", "",
              "| maps | worker PSS | worker private (dirty) | worker mappings | fork server PSS "
              "| fork server private |",
              "|---|---|---|---|---|---|"]
    top: Callable[[tuple[str, dict]], int] = lambda kv: -kv[1]["Pss"]
    for path, m in sorted(w["mappings"].items(), key=top)[:10]:
        theirs = s["mappings"].get(path, {"Pss": 0, "Private_Dirty": 0, "Private_Clean": 0})
        lines.append(f"| {path} | {m['Pss']:,} | {m['Private_Dirty'] + m['Private_Clean']:,} ({m['Private_Dirty']:,}) "
                     f"| {m['count']} | {theirs['Pss']:,} | {theirs['Private_Dirty'] + theirs['Private_Clean']:,} |")
    broker = b["broker"]
    lines += ["", f"the broker: PSS {broker['rollup']['Pss']:,} KiB, most of it "
                  + ", ".join(f"{what} {m['Pss']:,}" for what, m in sorted(broker["mappings"].items(), key=top)[:3])]
    lines += ["", "the worker's largest mappings by private dirty pages (KiB):", "",
              "| maps | size | Rss | private dirty |", "|---|---|---|---|"]
    for m in w["largest_private"]:
        lines.append(f"| {m['what']} | {m['Size']:,} | {m['Rss']:,} | {m['Private_Dirty']:,} |")
    return lines


if __name__ == "__main__":
    print("\n".join(render_many(bench_many("--quick" in sys.argv))))
