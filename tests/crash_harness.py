"""Crash consistency (issue 22, item 3): kill a process at many seeded points while it writes an
artefact, run it again, and check that the next run reuses a complete artefact or rebuilds it,
never trusts a partial one, and that a resumed run ends where an uninterrupted one does.

Run by tests/test_crash_consistency.py as `python tests/crash_harness.py SPEC.json REPORT.json`
(not collected by pytest). This process imports everything once and runs no torch op; every run
is an os.fork()ed child (tests/crash_child.py) that calls the product's own entry point
(tests/crash_artefacts.py; torch.set_num_threads(1) there).
Kill points are of two kinds, drawn by a seeded generator:
  * event k: the child's k-th filesystem event inside the trial folder (an audit hook sees every
    open for writing, rename/replace, remove, mkdir, rmdir, rmtree, copyfile, chmod, utime) kills
    the child (SIGKILL, itself) just before that event happens; k in 1..N, N counted in an
    uninterrupted run. Writes made by compiled code (safetensors) raise no event: delays reach them;
  * delay d: the parent SIGKILLs the child once its operation has run d seconds of CPU time (a busy
    machine moves no point), d uniform within DELAY_SPAN of the fastest uninterrupted run's.
Of each artefact's kill points SIGKILLS are real SIGKILLs; at the others one run is frozen (paused
in its audit hook at an event, SIGSTOPped at a delay) while the folder is copied, which leaves the
state a SIGKILL there would (the disk holds the same bytes; nothing runs on a SIGKILL) at a
fraction of the cost; each SIGKILL at an event is checked against the copy frozen at that event.
Every run happens in one folder (paths enter cache keys), emptied between kill points. After each
kill the folder is snapshotted (every file's hash, inode and mtime), the operation runs again to
the end in a fresh child, and its final artefacts must equal the uninterrupted run's (byte for
byte, or as the artefact's own normalisation says where a file holds timings). A unit (one
artefact: a folder or file under cache/sequoia-offload/<kind>/ or out/) counts as reused when the next run kept
the very files the kill left (same inode, mtime and bytes), else rebuilt. A post-kill state equal
(names of temporaries aside) to one already run again is not run again: the product is a function
of the files it finds, so its verdict is the same (counted as `memoized`).
`durability` mode checks the power-cut side: every rename publishing an artefact comes after an
fsync of what it publishes and is followed by an fsync of the folder that holds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from crash_child import Run, run_child  # noqa: E402

TEMP = re.compile(r"\.tmp-[0-9a-f]+")  # the names temporaries are written under (fsutil, formats, runtime)
# a store's name ends with its key, made of its checkpoint's mtimes: a sidecar written in another run
# has another (runs are compared by the store's content)
STORE_KEY = re.compile(r"^(cache/sequoia-offload/stores/[^/]*)-[0-9a-f]{16}(?=/|$)")


# ---- snapshots, units and verdicts ----------------------------------------------------------------

def snapshot(art, root: Path) -> dict[str, tuple]:
    """relative path -> ("dir",) or (hash of its normalised bytes, inode, mtime_ns)."""
    out = {}
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        for name in dirs:
            out[os.path.normpath(os.path.join(rel, name))] = ("dir",)
        for name in files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            relp = os.path.normpath(os.path.join(rel, name))
            with open(p, "rb") as f:
                data = art.normalise(relp, f.read())
            out[relp] = (hashlib.sha256(data).hexdigest(), st.st_ino, st.st_mtime_ns)
    return out


def unit_of(rel: str) -> str | None:
    """The artefact a path belongs to: cache/sequoia-offload/<kind>/<name> or out/<name> (None for
    the folders holding them)."""
    parts = rel.split(os.sep)
    depth = 4 if parts[0] == "cache" else 2
    return os.sep.join(parts[:depth]) if len(parts) >= depth else None


def kind_of(unit: str) -> str:
    name = unit.rsplit(os.sep, 1)[-1]
    if TEMP.search(name):
        return "temp"
    return "work" if name.endswith(".partial") else "final"


def same_name(rel: str) -> str:
    """A path as runs are compared: pids and random tokens of temporaries, and store keys, aside."""
    return STORE_KEY.sub(r"\1-*", TEMP.sub(".tmp-*", rel))


def units(snap: dict, kind: str = "final") -> dict[str, dict]:
    out: dict[str, dict] = {}
    for rel, entry in snap.items():
        u = unit_of(rel)
        if u is not None and kind_of(u) == kind:
            out.setdefault(same_name(u), {})[same_name(rel)] = entry
    return out


def content(unit_files: dict) -> dict:
    return {rel: entry[0] for rel, entry in unit_files.items()}


def state_key(snap: dict) -> str:
    """A post-kill state, names of temporaries aside (they carry a pid or a random token)."""
    items = sorted((same_name(rel), entry[0]) for rel, entry in snap.items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def verdict(art, ctx, ref_snap: dict, ref_run: Run, post: dict, rerun: Run, after: dict) -> dict:
    """Errors of a next run, and how it treated each artefact (reused or rebuilt)."""
    errors = art.check(ctx, rerun, ref_run, post)
    if "Traceback" in rerun.log:
        errors.append("the next run printed a traceback: " + rerun.log[-600:])
    ref_u, new_u, before = units(ref_snap), units(after), units(post)
    if set(ref_u) != set(new_u):
        errors.append(f"artefacts differ from the uninterrupted run's: missing {sorted(set(ref_u) - set(new_u))}, "
                      f"extra {sorted(set(new_u) - set(ref_u))}")
    reuse = {}
    for u in sorted(set(ref_u) & set(new_u)):
        if content(new_u[u]) != content(ref_u[u]):
            bad = sorted(r for r in set(ref_u[u]) | set(new_u[u]) if ref_u[u].get(r, ("",))[0] != new_u[u].get(r, ("",))[0])
            errors.append(f"{u}: differs from the uninterrupted run's ({', '.join(bad[:4])})")
        errors += art.validate(ctx, u)
        reuse[u] = "reused" if u in before and before[u] == new_u[u] else "rebuilt"
    left = units(after, "work")
    if left:
        errors.append(f"work folders left after a finished run: {sorted(left)}")
    partial = sorted(u for u in before if u in ref_u and content(before[u]) != content(ref_u[u]))
    return {"errors": errors, "reuse": reuse, "temps_left": len(units(after, "temp")), "partial_present": partial}


def phase(art, ctx, events: list, finished: bool) -> str:
    """Where a kill landed: the artefact and stage of the last filesystem event before it."""
    if finished:
        return "finished first"
    events = [e for e in events if e[0] == "event"]
    if not events:
        return "before any write"
    _, event, path, target = events[-1]
    rel = os.path.relpath(target if event == "os.rename" and target else path, ctx.live)
    unit = unit_of(rel)
    if unit is None:
        return "making the cache folders"
    kind = art.label(unit)
    if event == "os.rename":
        return f"{kind}: publishing (rename)"
    stage = {"temp": "writing its temporary", "work": "saving its work folder"}.get(kind_of(unit), "on the final name")
    if event in ("os.remove", "os.rmdir", "shutil.rmtree"):
        stage = "removing " + ("a temporary" if kind_of(unit) == "temp" else "files")
    return f"{kind}: {stage}"


# ---- the trials ----------------------------------------------------------------------------------

DELAY_SPAN = 0.8  # delays are drawn within this share of an uninterrupted run's CPU time
SIGKILLS = 4  # of each artefact's kill points, real SIGKILLs; the others freeze one run and copy its folder


def fresh(ctx, art) -> None:
    if ctx.live.exists():
        shutil.rmtree(ctx.live)
    ctx.live.mkdir(parents=True)
    art.prepare(ctx)


def restore(ctx, saved: Path) -> None:
    shutil.rmtree(ctx.live)
    shutil.copytree(saved, ctx.live, symlinks=True)  # mtimes kept (temporaries are swept by age)


class Trials:
    """One artefact's kill points and the verdicts of their next runs."""

    def __init__(self, art, ctx, kills: int, rng: random.Random):
        self.art, self.ctx, self.kills, self.rng = art, ctx, kills, rng
        self.report = {"reference_s": 0.0, "events": 0, "kills": Counter(), "by": Counter(), "landed": Counter(),
                       "phases": Counter(), "reused": Counter(), "rebuilt": Counter(), "resumed": 0,
                       "next_runs": 0, "memoized": 0, "temps_left": 0, "partial_present": 0,
                       "sigkill_vs_frozen": Counter(), "failures": []}
        self.memo: dict[str, dict] = {}

    def run(self) -> dict:
        """The reference run; a run frozen at the event kill points; the SIGKILLs (each event one
        checked against the frozen copy at its event); a run frozen at the delay kill points.
        Delays are fractions of the fastest uninterrupted run (the reference or the frozen one)."""
        art, ctx, report = self.art, self.ctx, self.report
        fresh(ctx, art)
        initial = snapshot(art, ctx.live)
        ref = self.ref = run_child(art, ctx, True, query=True)
        self.ref_snap = snapshot(art, ctx.live)
        report["reference_s"], report["reference_cpu_s"] = round(ref.duration or 0, 3), round(ref.cpu_s or 0, 3)
        if not ref.finished or art.check(ctx, ref, ref, {}):
            report["failures"].append(f"the uninterrupted run failed: status {ref.status}\n{ref.log[-2000:]}")
            return _plain(report)
        self.memo[state_key(initial)] = verdict(art, ctx, self.ref_snap, ref, initial, ref, self.ref_snap)
        # (a server's kill points among the events before it answered: the killed runs are not queried)
        reachable = ref.events if ref.events_at_served is None else ref.events[:ref.events_at_served]
        n_events = report["events"] = sum(1 for e in reachable if e[0] == "event")
        report["writes"] = dict(Counter(self.write_kind(e) for e in ref.events if e[0] == "event"))
        points = [(i, "event", self.rng.randint(1, max(n_events, 1))) if i % 2 == 0
                  else (i, "delay", self.rng.random()) for i in range(self.kills)]
        real, frozen = points[:SIGKILLS], points[SIGKILLS:]
        saves = ctx.work / "saved"
        shutil.rmtree(saves, ignore_errors=True)
        extra = {v for _, kind, v in real if kind == "event"}
        saved, duration = self.frozen([p for p in frozen if p[1] == "event"], "event", saves, extra)
        # within the fastest uninterrupted run's CPU time, less a fifth: runs vary that much here (a
        # profile's loops are bounded in wall time), and a delay past a run's end kills nothing
        scale = report["delay_scale_cpu_s"] = DELAY_SPAN * min(ref.cpu_s, duration or ref.cpu_s)
        for i, kind, value in real:
            self.sigkill(i, kind, value if kind == "event" else value * scale, saved)
        _, report["delay_run_cpu_s"] = self.frozen([(i, k, v * scale) for i, k, v in frozen if k == "delay"], "delay", saves)
        shutil.rmtree(saves, ignore_errors=True)
        return _plain(report)

    def sigkill(self, i: int, kind: str, value, saved: dict) -> None:
        art, ctx, report = self.art, self.ctx, self.report
        fresh(ctx, art)
        run = run_child(art, ctx, True, **({"event_k": value} if kind == "event" else {"delay": value}))
        report["landed"][kind] += run.killed_by is not None
        if "Traceback" in run.log or run.hung or (run.killed_by is None and not run.finished):
            report["failures"].append(f"kill point {i} ({kind}): the interrupted run itself failed "
                                      f"(status {run.status}, hung {run.hung}):\n{run.log[-1500:]}")
            return
        post = state_key(snapshot(art, ctx.live))
        if kind == "event" and run.killed_by and value in saved:  # a SIGKILL at event k leaves what freezing there shows
            same = post == saved[value][2]
            report["sigkill_vs_frozen"]["same" if same else "different"] += 1
            if not same:
                report["failures"].append(f"event {value}: a SIGKILL left another state than freezing there")
        self.judge(i, kind, "sigkill", phase(art, ctx, run.events, run.finished))

    def frozen(self, points: list, kind: str, saves: Path, extra: set = frozenset()) -> tuple[dict, float | None]:
        """One run frozen at each point of `points` (and of `extra`, kept for the SIGKILLs), its
        folder copied there; then each point's next run. Returns the copies and the run's time."""
        art, ctx = self.art, self.ctx
        want, saved = {v for _, _, v in points} | set(extra), {}

        def on_freeze(kind_, value, events):
            if value in want and value not in saved:
                dest = saves / f"{kind}-{len(saved)}"
                shutil.copytree(ctx.live, dest, symlinks=True)
                saved[value] = (dest, phase(art, ctx, events, False), state_key(snapshot(art, dest)))
        fresh(ctx, art)
        run = run_child(art, ctx, True, pause_at=want if kind == "event" else (),
                        freeze_at=[v for _, _, v in points] if kind == "delay" else (), on_freeze=on_freeze)
        if "Traceback" in run.log or run.hung or not run.finished:
            self.report["failures"].append(f"the frozen {kind} run failed (status {run.status}):\n{run.log[-1500:]}")
            return saved, None
        final = saves / f"{kind}-final"
        shutil.copytree(ctx.live, final, symlinks=True)
        for i, _, value in points:
            dest, where, _ = saved.get(value, (final, "finished first", None))
            self.report["landed"][kind] += dest != final
            restore(ctx, dest)
            self.judge(i, kind, "frozen", where)
        return saved, run.cpu_s

    def write_kind(self, e: list) -> str:
        """'<artefact>: <event>' of an uninterrupted run's event (what it writes, where)."""
        unit = unit_of(os.path.relpath(e[3] if e[1] == "os.rename" and e[3] else e[2], self.ctx.live))
        where = "cache folders" if unit is None else self.art.label(unit) + (" (temporary)" if kind_of(unit) == "temp" else "")
        return f"{where}: {e[1]}"

    def judge(self, i: int, kind: str, how: str, where: str) -> str:
        """The next run from the state in ctx.live (memoized by state); returns the state's key."""
        art, ctx, report = self.art, self.ctx, self.report
        report["kills"][kind] += 1
        report["by"][how] += 1
        report["phases"][where] += 1
        post = snapshot(art, ctx.live)
        key = state_key(post)
        if key in self.memo:
            report["memoized"] += 1
        else:
            rerun = run_child(art, ctx, False, query=True)
            report["next_runs"] += 1
            v = self.memo[key] = verdict(art, ctx, self.ref_snap, self.ref, post, rerun, snapshot(art, ctx.live))
            v["resumed"] = bool(isinstance(rerun.result, dict) and rerun.result.get("resumed"))
        v = self.memo[key]
        for u, reuse in v["reuse"].items():
            report[reuse][art.label(u)] += 1
        report["resumed"] += v.get("resumed", False)
        report["temps_left"] += v["temps_left"]
        report["partial_present"] += bool(v["partial_present"])
        report["failures"] += [f"kill point {i} ({kind}, {how}, {where}): {e}" for e in v["errors"]]
        return key


def _plain(report: dict) -> dict:
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in report.items()}


def durability(art, ctx) -> dict:
    """Every rename inside the trial folder: what it publishes was fsynced after its last write and
    before the rename, and the folder holding the new name is fsynced after it."""
    fresh(ctx, art)
    run = run_child(art, ctx, True, record_syncs=True)
    if not run.finished:
        return {"renames": 0, "violations": [f"the run failed: {run.log[-1500:]}"]}
    violations, renames = [], 0
    for i, ev in enumerate(run.events):
        if ev[0] != "rename":
            continue
        renames += 1
        _, src, dst, files, dirs = ev
        before = run.events[:i]
        for path in files + dirs:
            last_write = max((j for j, e in enumerate(before) if e[0] == "event" and e[2] == path), default=-1)
            if not any(e[0] == "fsync" and e[1] == path for e in before[last_write + 1:]):
                violations.append(f"{art.label(unit_of(os.path.relpath(dst, ctx.live)) or dst)}: "
                                  f"{os.path.relpath(path, ctx.live)} not fsynced before its rename")
        parent = os.path.dirname(dst)
        if not any(e[0] == "fsync" and e[1] == parent for e in run.events[i + 1:]):
            violations.append(f"{art.label(unit_of(os.path.relpath(dst, ctx.live)) or dst)}: "
                              f"{os.path.relpath(parent, ctx.live)} not fsynced after the rename to "
                              f"{os.path.basename(dst)}")
    return {"renames": renames, "violations": sorted(set(violations))}


class Context:
    def __init__(self, work: Path, fixtures: dict):
        self.work, self.fixtures = work, fixtures
        self.live = work / "live"
        self.runs, self.port, self.ref_query = 0, None, None
        (work / "logs").mkdir(parents=True, exist_ok=True)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    import crash_artefacts  # the operations; imports offload_engine (and torch), runs no torch op
    work = Path(spec["work"]).resolve()
    os.environ["XDG_CACHE_HOME"] = str(work / "shared-cache")
    crash_artefacts.prebuild_native()  # the compiled dequantizer, loaded once here: children inherit it
    ctx = Context(work, spec["fixtures"])
    report = {}
    for name in spec["artefacts"]:
        art = crash_artefacts.ARTEFACTS[name]
        started = time.perf_counter()
        rng = random.Random(f"{spec['seed']}-{name}")
        entry = Trials(art, ctx, spec["kills"], rng).run() if spec.get("kills") else {}
        if spec.get("durability"):
            entry["durability"] = durability(art, ctx)
        entry["wall_s"] = round(time.perf_counter() - started, 2)
        report[name] = entry
        Path(argv[1]).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
