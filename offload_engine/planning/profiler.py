"""Measure a machine for the optimizer (`sequoia-offload profile`, and `--tree auto` on first use).

For one loaded engine (target placed by its plan, draft resident) it measures:
  * the streaming bandwidth: pinned host-to-device copies on a GPU; O_DIRECT reads of the layer
    store when layers stream from disk (the CPU's offload regime); nothing when all is resident;
  * t_target(n): one target pass over n new tokens after a `prefix`-token context, with a tree
    mask, its logits copied to the host, for n in
    TARGET_WIDTHS, stopping early when the time budget is spent (then the optimizer searches
    only the widths measured); a pass whose median sits off the line through its neighbours'
    is timed again back to back with them (`retime_bumps`);
  * t_draft(w): one draft level of w nodes (forward, probabilities and children drawn for each);
  * real speculation steps of several tree shapes (budgets 4 to 256, depths 3 to 12, and a plain
    step), greedy and sampled, each timed whole (the median of repeats), to which the step model
    the optimizer uses is fitted by least squares: step = t_target(n) + f * (the draft's levels)
    + a + b * n, with a the per-step constant (verification and commits add; the loader
    prefetching the next pass's first layers while the draft runs takes away, so it may be
    negative), b the per-node cost and f the share of the draft's time a step pays (below 1 when
    prefetching overlaps it). A plain step gets its own constant. The fit's error is measured by
    leaving each shape out in turn and predicting it from the others (`fit_cv_error`);
  * where layers stream, idle(n): the part of each timed target pass spent waiting for streamed
    layers (the executor's `idle_window_seconds`); with overlap on (the draft grows the next
    tree in those waits) the real steps run in pairs of one shape, and the share of the draft
    work fitting in the waits that the second step of each pair used is `overlap_use`
    (`fit_overlap_use`; the steps are fitted at what they would have cost without the levels
    grown ahead). `Timings.step` then models a step as max(pass, overlapped) + the draft work
    left.
Greedy and sampled decoding get their own draft times and step models: sampling costs more per
node. Every timing under half a second (every step; a pass: under a second) is the median of
three, the repeats taken round-robin over the widths (the shapes, both modes), not back to back,
and the passes' and levels' repeats in the rounds of the real steps (`_Repeats`): a slow spell of
a shared machine then falls on one repeat of each, and the medians leave it out. The timed trees
are shaped by the pair's own acceptance vectors where it has them (`shaping_vectors`): the trees
the optimizer will choose among. The step model's terms are chosen by cross-validation
(`fit_step_model`).

The profile is cached under <cache>/profiles/, keyed by the machine, the device and dtype, the
pair's fingerprints and the placement plan: another plan is another machine as far as timing goes.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

import torch
from tqdm import tqdm

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.optimizer import Timings
from sequoia_trees.sampling import SamplingParams, gumbel_top_k, logits_to_probs

from ..errors import UserError
from ..fsutil import atomic_write_text, cache_root
from ..runtime.placement import fmt_bytes
from .hw_profile import MeasuredProfile, load_measured

# the narrow widths too: the small trees a CPU or an on-chip target chooses are priced there, and
# t(n) is not linear below 16 (2-vCPU machine, 2026-12-03: a 2-node pass 0.18 s, a 1-node one 0.13,
# a 16-node one 0.24; interpolated between 1 and 16, a (2, 2) tree's step was predicted 24% short)
TARGET_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024)
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFIX_TOKENS = 128
DEFAULT_BUDGET_S = 120.0
PROFILE_VERSION = 10  # 10: passes off their neighbours' line timed again with them (`retime_bumps`); 9: the speed check's own readings recorded (`speed_now`); 5: the pass waits and the overlap used (drafting while the target streams); 6: the
# timed steps' trees shaped by the pair's own vectors (`shaping_vectors`); 7: self-q8/self-int8 levels timed
# with the CPU's integer GEMM only where it pays (`quant._wide_pays`: without VNNI it was 15x slower); 8: self-draft
# levels with fused q/k/v and gate/up matrices and an int8 head (`model.fuse_projections`)
# the real steps timed for the step model, most informative first (the time budget may cut the
# list after the fourth); the plain step always runs last
STEP_SHAPES = ((64, 8), (4, 3), (16, 4), (128, 10), (32, 6), (256, 12))
MIN_STEP_SHAPES = 4
# the target part's terms the step model may fit (`fit_step_model`), the fullest first: the one
# whose leave-one-shape-out error is lowest is kept (a tie keeps the fuller)
STEP_TERMS = ("constant and per node", "constant", "none")
# plain steps per mode and round: every choice is against plain decoding, and a plain step is
# short (one width-1 pass), so it gets more samples than one: with one per round, profiles taken
# minutes apart on a quiet machine put it between 0.084 and 0.098 s (2026-12-02)
PLAIN_STEPS = 4
# shapes the timed trees when the pair has no vector yet; with one, its own vectors shape them
# (`shaping_vectors`), so that a timed (n, d) step has the levels the optimizer will run: this
# vector's (64, 8) tree has 8 levels, the default pair's T=0 vector's 6 and wider ones, and a draft
# level's cost is far from proportional to its width (on the 2-vCPU machine a width-1 level took
# 35 ms alone, a width-16 one 82), so a draft factor fitted to one set of shapes misprices the other
PROFILE_VECTOR = AcceptanceVector((0.5, 0.2, 0.1, 0.05))


def shaping_vectors(engine) -> dict[bool, AcceptanceVector]:
    """The vectors that shape the timed steps' trees, greedy (True) and sampled (False): the
    pair's own, stored or cached (the nearest to T=0, and to T=0.6 among the sampled ones), else
    PROFILE_VECTOR, also where the pair's cannot shape every one of STEP_SHAPES (a vector of
    width 2 has no (16, 4) tree)."""
    from ..speculation.acceptance_store import known_vectors, nearest
    found = known_vectors(engine.target_fingerprint, engine.draft_key)
    out = {True: PROFILE_VECTOR, False: PROFILE_VECTOR}
    for greedy, t in ((True, 0.0), (False, 0.6)):
        same_kind = {k: v for k, v in found.items() if (k == 0) == greedy} or found
        if same_kind:
            vector = nearest(same_kind, t)[0]
            k = vector.width
            if all(sum(k ** i for i in range(d)) >= n for n, d in STEP_SHAPES):  # room for n nodes in d levels
                out[greedy] = vector
    return out


def step_widths(vector: AcceptanceVector, n: int, d: int) -> tuple[int, ...]:
    """The level widths of the optimal (n, d) tree for `vector` (the timed steps' trees)."""
    from sequoia_trees.dp import TreeTable
    from sequoia_trees.optimizer import level_widths
    return tuple(level_widths(TreeTable(vector, n, d).tree(n, d)))


# the vector extensions the CPU's kernels take different paths on (a cloud VM's "AMD EPYC" is
# sometimes a host with AVX-512 VNNI, sometimes one with AVX2 only: int8 GEMMs 15x apart)
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")


def machine_name(device: torch.device) -> str:
    """'CPU model xCORES (its vector extensions)', '+ GPU name' on CUDA: part of a profile's key."""
    cpu, flags, named = platform.processor() or platform.machine(), set(), False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not named:  # (the first processor's)
                cpu, named = line.split(":", 1)[1].strip(), True
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    name = f"{cpu} x{os.cpu_count()}"
    features = [f for f in CPU_FEATURES if f in flags]
    if features:
        name += f" ({', '.join(features)})"
    if device.type == "cuda":
        name += f" + {torch.cuda.get_device_name(device)}"
    return name


def profile_key(engine, draft: bool = True) -> str:
    """The profile's cache key: the machine, device, dtype, the pair, the plan and whether the
    draft grows trees during the pass (without the draft: the key of the target's part, which
    every draft on the same plan shares)."""
    plan = engine.plan
    ident = {"v": PROFILE_VERSION, "machine": machine_name(engine.model.device), "device": str(engine.model.device),
             "dtype": str(engine.model.dtype), "target": engine.target_fingerprint,
             "draft": engine.draft_key if draft else None,
             **({"overlap": True} if draft and getattr(engine, "overlap", False) else {}),
             "plan": [len(plan.resident_layers), len(plan.ram_layers), len(plan.disk_layers), plan.buffers,
                      plan.bytes_per_pass, plan.weights, plan.resident_format]}  # formats change the timings
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def target_part_path(engine) -> Path:
    """Where the target's part of a profile (its passes by width, their waits, the stream's
    bandwidth) is kept for the next draft profiled on the same target, plan and machine."""
    return cache_root() / "profiles" / f"{engine.folder.name}-target-{profile_key(engine, draft=False)}.json"


def read_target_part(path: Path) -> dict | None:
    """A target part (`target_part_path`) as written, checked as the optimizer checks timings;
    None when there is none or it does not read whole (it is then measured again)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        part = {k: data[k] for k in ("target_tokens", "target_pass_s", "target_idle_s", "stream_source",
                                     "stream_gb_per_s")}
        Timings(tuple(part["target_tokens"]), tuple(part["target_pass_s"]), (1,), (0.0,),
                idle_seconds=tuple(part["target_idle_s"]))
        part["check_target_s"] = float(data.get("check_target_s", 0.0))  # (0: not recorded)
        if not isinstance(part["stream_source"], str) or not part["stream_gb_per_s"] >= 0 \
                or not part["check_target_s"] >= 0:
            return None
        return part
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def _shared_target_part(engine) -> dict | None:
    return read_target_part(target_part_path(engine))


def _write_target_part(engine, prof: MeasuredProfile) -> None:
    atomic_write_text(target_part_path(engine), json.dumps({
        "target_tokens": prof.target_tokens, "target_pass_s": prof.target_pass_s, "target_idle_s": prof.target_idle_s,
        "stream_source": prof.stream_source, "stream_gb_per_s": prof.stream_gb_per_s,
        "check_target_s": prof.check_target_s,
        "measured_at": prof.measured_at}, indent=2) + "\n")


def profile_path(engine) -> Path:
    return cache_root() / "profiles" / f"{engine.folder.name}-{profile_key(engine)}.json"


def cached_or_measured(engine, budget_s: float = DEFAULT_BUDGET_S, progress: bool = True,
                       force: bool = False) -> tuple[MeasuredProfile, Path, bool]:
    """(profile, its file, whether it was measured now)."""
    path = profile_path(engine)
    if path.exists() and not force:
        try:
            prof = load_measured(path)
            if _shared_target_part(engine) is None:  # (a run stopped between the two files)
                _write_target_part(engine, prof)
            vectors = shaping_vectors(engine)
            if not prof.fit_budgets or (prof.fit_vector_greedy, prof.fit_vector) == (_own(vectors[True]),
                                                                                   _own(vectors[False])):
                return prof, path, False
            # its steps were timed on other trees than the pair's vectors now shape (a profile
            # taken before the pair had vectors): the step model would be fitted to the wrong trees
            if progress:
                print("sequoia-offload: the cached profile timed other trees than this pair's acceptance vectors "
                      "shape; measuring again", file=sys.stderr)
        except UserError as e:
            print(f"sequoia-offload: warning: {e}; measuring again", file=sys.stderr)
    prof = measure(engine, budget_s, progress, reuse_target=not force)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, prof.to_json())
    _write_target_part(engine, prof)
    return prof, path, True


# The speed check (`speed_now`): a shared machine's speed moves by tens of percent within hours
# (the 2-vCPU machine, 2026-12-04: a profile cached at 16:18 had draft levels 1.2-2x and target
# passes 1.1-1.3x the times measured at 18:10; the demo printed 2.74x predicted and measured
# 2.25x), so a profile records two cheap readings when it is measured (`check_readings`: the
# median of one in each round of its timed steps and one at its end), and they are taken again,
# the same way, each time it is used: the target's one-token pass (where
# it takes under CHECK_MAX_PASS_S: a 70B pass streamed over PCIe takes seconds and is left to the
# online planner) and the draft's CHECK_WIDTH-wide greedy level, each the median of CHECK_REPEATS
# back to back after a warm-up. Only a reading taken the same way compares: against the profile's
# own table, a level timed back to back read 0.6x (no loader thread beside it) where the steps ran
# 0.8x, and a pass timed after a draft level read low (the loader had prefetched its first
# layers). Both parts of the profile are rescaled by their own ratios (`rescaled`: rescaling only
# a part that moved left the other off in the same direction), each ratio held within
# [1/CHECK_MAX_SCALE, CHECK_MAX_SCALE] (five timings in a load spike can read 9x; the line then
# says so, and `profile --force` measures the machine again) and taken to the power CHECK_TRUST:
# a reading is half believed. It is a second's sample of a machine whose speed moves in spells,
# and a run lasts minutes: on the 2-vCPU machine (2026-12-07) the check's readings taken back to
# back for 150 s swung with spells of 10-40 s, the draft's 16-wide level between 44 and 88 ms and
# the one-token pass between 92 and 151 ms; over the six validations that recorded their check
# (benchmarks/results_validate_simulator_1207_{run,newref_run,retime_run}{1,2}.json) the runs'
# own plain steps moved by 0.43 of the check's one-token ratio (a least-squares slope in logs,
# through the origin), and their (64, 8) draft work by 0.11 of its draft ratio (a check that read
# the draft 1.63x, twice, found it 1.03x in the run). Under the rule they ran (the whole ratio,
# past 20% only) 1 of the 6 was within 15% for every shape; recomputed from their recorded parts
# with the ratios to the power 0.5 on every load, 5 were (the sixth's (16, 4) went from -13.8% to
# -19.1%: its draft had moved 1.32x, and its check read 1.21x).
# Where the profile's one-token pass waited for streamed layers, its move is split between its
# compute (as the draft's level moved) and its waits (the rest), and each pass is rescaled part by
# part (`SpeedCheck.split`): a slower disk costs plain decoding and hardly the trees' wide passes
# (the validation of 2026-12-07: one ratio of 1.44 on every pass put the trees 16-22% slow).
# When either ratio is beyond CHECK_TOLERANCE of 1, the readings are taken a second time and each
# part keeps the one nearer the profile's (`speed_now`). Until 2026-12-07 the profile was rescaled
# (whole) only past the tolerance, and kept as measured within it (on the 2-vCPU machine the same
# one-token pass read 104-137 ms in four loads within three minutes, 2026-12-04: a tolerance of
# 10% had rescaled on noise); half believed, a reading within it moves the prediction by under
# 10%, and a run 17% slower than its profile, where the check read 1.17x twice, was predicted
# 18% fast as measured and 12% fast rescaled.
CHECK_REPEATS = 5
CHECK_WIDTH = 16
CHECK_MAX_PASS_S = 0.5
CHECK_TOLERANCE = 0.20
CHECK_MAX_SCALE = 3.0
CHECK_TRUST = 0.5
SPLIT_MIN_SHARE = 0.1


@dataclass(frozen=True)
class SpeedCheck:
    """A cached profile's readings taken again (`speed_now`): seconds now and in the profile."""
    target_now: float | None  # the one-token target pass (None: not timed, see CHECK_MAX_PASS_S)
    target_then: float | None
    draft_now: float | None  # the draft's CHECK_WIDTH-wide greedy level (None: no such width measured)
    draft_then: float | None
    measured_at: str = ""  # the profile's time stamp
    # (target, draft) seconds of a first reading that moved and was taken again (`speed_now`);
    # None: read once
    first: tuple | None = None
    second: tuple | None = None  # ... and the second readings, of which the nearer were kept
    # the profile's one-token pass's share spent waiting for streamed layers (`target_idle_s` over
    # `target_pass_s` at one token; None: not known; 0: no waits): with the draft read too, the
    # pass's move is split into its compute's (moving as the draft's levels do) and its waits'
    # (the rest), and each part of every pass is scaled by its own (`split`)
    wait_share: float | None = None

    @staticmethod
    def _ratio(now, then) -> float | None:
        return None if now is None or not then else _held(now / then)

    @property
    def clamped(self) -> bool:
        """Whether a reading was past CHECK_MAX_SCALE of the profile's (its scale held there)."""
        return any(now is not None and then and not 1 / CHECK_MAX_SCALE <= now / then <= CHECK_MAX_SCALE
                   for now, then in ((self.target_now, self.target_then), (self.draft_now, self.draft_then)))

    @property
    def moved(self) -> bool:
        """Whether either reading is beyond CHECK_TOLERANCE of the profile's (it is then read twice)."""
        return any(r is not None and abs(r - 1) > CHECK_TOLERANCE
                   for r in (self._ratio(self.target_now, self.target_then),
                             self._ratio(self.draft_now, self.draft_then)))

    @property
    def target_ratio(self) -> float | None:
        """The target pass read now over the profile's, held within CHECK_MAX_SCALE (None: not read)."""
        return self._ratio(self.target_now, self.target_then)

    @property
    def split(self) -> tuple[float, float] | None:
        """(the target passes' compute scale, their waits' scale), each ratio ** CHECK_TRUST, when
        the one-token pass's move can be split (both read, and the profile's pass waited for
        streamed layers): its compute moves as the draft's levels do (the same cores and kernels),
        and its waits (share w) take the rest of the reading's move, r_waits = (r_target - (1 - w)
        r_draft) / w, held within CHECK_MAX_SCALE. A slower disk then costs the narrow passes,
        which wait, and hardly the wide ones, which compute while the loader reads ahead (the
        2-vCPU machine, 2026-12-07: a check read the one-token pass at 1.44x and the draft at 0.98x;
        plain decoding measured 1.17x its profile, the trees' steps 0.99-1.04x, and every pass
        scaled by 1.44 predicted the trees 16-22% slow). None: the one ratio for every part, also
        where the waits are under SPLIT_MIN_SHARE of the pass (the readings' noise is multiplied by
        1 / w in r_waits) or the split does not fit (r_waits past CHECK_MAX_SCALE either way: the
        readings disagree more than a split explains, and holding r_waits there would leave the
        pass's own reading mostly unused)."""
        r_t, r_d, w = self.target_ratio, self._ratio(self.draft_now, self.draft_then), self.wait_share
        if r_t is None or r_d is None or w is None or not SPLIT_MIN_SHARE <= w < 1.0:
            return None
        r_w = (r_t - (1.0 - w) * r_d) / w
        if not 1 / CHECK_MAX_SCALE <= r_w <= CHECK_MAX_SCALE:
            return None
        return r_d ** CHECK_TRUST, r_w ** CHECK_TRUST

    @property
    def target(self) -> float | None:
        """The one-token target pass's scale (None: not read): target_ratio ** CHECK_TRUST, or,
        split (`split`), its compute's and its waits' scales weighed by their shares."""
        r, parts = self.target_ratio, self.split
        if r is None:
            return None
        if parts is None:
            return r ** CHECK_TRUST
        return (1.0 - self.wait_share) * parts[0] + self.wait_share * parts[1]

    @property
    def draft(self) -> float | None:
        """The draft levels' scale: their reading now over the profile's, held within
        CHECK_MAX_SCALE, ** CHECK_TRUST (None: not read)."""
        r = self._ratio(self.draft_now, self.draft_then)
        return None if r is None else r ** CHECK_TRUST

    @property
    def spell(self) -> float:
        """How far the machine's speed may be from the prediction's (a log): the larger of the
        part of the readings' move not taken (|log(now / profile) - log(scale applied)|: 1 -
        CHECK_TRUST of it, more where a reading was held at CHECK_MAX_SCALE) and, when they were
        read twice, how far the two readings of a part disagreed. 0 when nothing was read."""
        left = [abs(math.log(now / then) - math.log(scale))
                for now, then, scale in ((self.target_now, self.target_then, self.target),
                                         (self.draft_now, self.draft_then, self.draft)) if now and then]
        pairs = [(a, b) for a, b in zip(self.first or (), self.second or ()) if a and b]
        return max([0.0] + left + [abs(math.log(a / b)) for a, b in pairs])

    def as_dict(self) -> dict:
        parts = self.split
        return {"target_now_s": self.target_now, "target_profile_s": self.target_then,
                "draft_now_s": self.draft_now, "draft_profile_s": self.draft_then,
                "target_scale": self.target, "draft_scale": self.draft, "profile_measured_at": self.measured_at,
                "wait_share": self.wait_share, "target_compute_scale": None if parts is None else parts[0],
                "target_wait_scale": None if parts is None else parts[1],
                "first_reading_s": None if self.first is None else list(self.first),
                "second_reading_s": None if self.second is None else list(self.second), "spell": self.spell}

    def describe(self, done: str = "is rescaled") -> str:
        """One line: the readings against the profile's and what is done with it (`done`: what
        happens to the profile's parts, rescaled by the check on every load)."""
        parts = []
        for what, now, then in (("a one-token target pass", self.target_now, self.target_then),
                                (f"a {CHECK_WIDTH}-wide draft level", self.draft_now, self.draft_then)):
            if now is not None and then:
                parts.append(f"{what} {now * 1e3:.1f} ms (profile: {then * 1e3:.1f}, {now / then:.2f}x)")
        if not parts:
            return "speed check: nothing cheap enough to time again"
        if self.first is not None:
            before = ", ".join(f"{x * 1e3:.1f}" for x in self.first if x is not None)
            parts[-1] += f" (read twice; the first time {before} ms: each part taken as far as both readings agree)"
        split, items = self.split, []
        if split is not None:
            items.append(f"target passes' compute {split[0]:.2f}x and their waits for streamed layers "
                         f"{split[1]:.2f}x (a one-token pass {self.target:.2f}x)")
        elif self.target is not None:
            items.append(f"target passes {self.target:.2f}x")
        if self.draft is not None:
            items.append(f"draft levels {self.draft:.2f}x")
        scales = " and ".join(items)
        tail = (f"; the profile {done}: its {scales} (the readings' ratios to the power {CHECK_TRUST:g}: a second's "
                "reading of a machine that moves in spells; `profile --force` measures it all again)")
        if self.clamped:
            tail += (f"; a reading past {CHECK_MAX_SCALE:g}x the profile's is held at {CHECK_MAX_SCALE:g}x (a "
                     "machine this much faster or slower than when profiled: `profile --force` measures it again)")
        return f"speed check against the profile of {self.measured_at}: " + ", ".join(parts) + tail


def speed_now(engine, prof: MeasuredProfile, repeats: int = CHECK_REPEATS) -> SpeedCheck:
    """The profile's check readings (`check_readings`, recorded when it was measured) taken
    again on the loaded engine; a reading the profile did not record is not taken. When they
    find the machine moved, they are taken a second time, and each part keeps the reading nearer
    the profile's (a move is believed as far as two readings agree)."""
    def read() -> SpeedCheck:
        target_now, draft_now = check_readings(engine, prof.prefix_tokens, repeats,
                                               target=prof.check_target_s > 0, draft=prof.check_draft_s > 0)
        return SpeedCheck(target_now, prof.check_target_s or None, draft_now, prof.check_draft_s or None,
                          prof.measured_at, wait_share=_wait_share(prof))
    check = read()
    if not check.moved:
        return check
    # a move is taken again before it is believed: a reading taken in a slow second carried into
    # the prediction (the demo, 2026-12-05: a 16-wide level read 49.5 and 50.1 ms against the
    # profile's 34.3, the draft's levels were rescaled 1.45x, and the answer's steps that followed
    # ran 10-18% faster than so predicted); each part keeps the reading nearer the profile's
    again = read()

    def nearer(a, b, then):
        if a is None or b is None or not then:
            return a if b is None else b
        return min(a, b, key=lambda x: abs(math.log(x / then)))
    return replace(again, target_now=nearer(check.target_now, again.target_now, check.target_then),
                   draft_now=nearer(check.draft_now, again.draft_now, check.draft_then),
                   first=(check.target_now, check.draft_now), second=(again.target_now, again.draft_now))


def check_readings(engine, prefix_tokens: int = PREFIX_TOKENS, repeats: int = CHECK_REPEATS, target: bool = True,
                   draft: bool = True) -> tuple[float | None, float | None]:
    """(the target's one-token pass, the draft's CHECK_WIDTH-wide greedy level) in seconds, each
    after a random prefix of `prefix_tokens`, the median of `repeats` back to back after a
    warm-up; the pass is not taken (None) when a first one takes over CHECK_MAX_PASS_S, the
    level when there is no draft (or when not asked for)."""
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=g)
    target_s = draft_s = None
    if target:
        job = _target_pass_job(engine.model, _prefixed_cache(engine.model, prefix, 1), 1, g, vocab)
        if _timed(job, engine.model.device) <= CHECK_MAX_PASS_S:  # (the warm-up)
            target_s = statistics.median(_timed(job, engine.model.device) for _ in range(repeats))
    if draft and engine.draft is not None:
        d = engine.draft
        job = _draft_level_job(d, _prefixed_cache(d, prefix, CHECK_WIDTH), CHECK_WIDTH, True, g, g, vocab)
        _timed(job, d.device)
        draft_s = statistics.median(_timed(job, d.device) for _ in range(repeats))
    return target_s, draft_s


def _median_of(readings) -> float | None:
    """The median of the readings taken (None: none was)."""
    taken = [r for r in readings if r is not None]
    return statistics.median(taken) if taken else None


def _wait_share(prof: MeasuredProfile) -> float | None:
    """The profile's one-token pass's share spent waiting for streamed layers (None: no one-token
    pass, or no waits recorded; 0: it did not wait)."""
    if not prof.target_idle_s or not prof.target_tokens or prof.target_tokens[0] != 1 or not prof.target_pass_s[0]:
        return None
    return min(max(prof.target_idle_s[0] / prof.target_pass_s[0], 0.0), 1.0)


def rescaled(prof: MeasuredProfile, check: SpeedCheck) -> MeasuredProfile:
    """The profile with its target passes (and their waits for streamed layers) scaled by the
    check's target scale, or, where the check splits it (`SpeedCheck.split`), each pass's compute
    (its time less its waits) by the compute's scale and its waits by theirs; its draft levels
    (greedy and sampled) by the draft scale (a reading not taken: that part as measured). The
    step model's fitted constants (per step, per node, the plain step's) and the overlap's shares
    are kept: they are small beside the passes and levels, and a ratio is no better a guess for
    them than 1."""
    def scale(values, r):
        return tuple(v * r for v in values) if r is not None else tuple(values)
    parts = check.split
    if parts is not None and len(prof.target_idle_s) == len(prof.target_pass_s):
        compute, waits = parts
        passes = tuple((p - i) * compute + i * waits for p, i in zip(prof.target_pass_s, prof.target_idle_s))
        idle = scale(prof.target_idle_s, waits)
    else:
        passes, idle = scale(prof.target_pass_s, check.target), scale(prof.target_idle_s, check.target)
    return replace(prof, target_pass_s=passes, target_idle_s=idle,
                   draft_level_s=scale(prof.draft_level_s, check.draft),
                   draft_level_greedy_s=scale(prof.draft_level_greedy_s, check.draft))


# The step check (`step_check`): the speed check above times two pieces of a step, each against a
# reading the profile took between its timed steps, and a reading taken in a slow spell of the
# profile leaves the levels it scales off by as much (the 2-vCPU machine, 2026-12-07: a profile
# whose draft levels were swept in a slow spell, its check's reference 14% off its own level;
# the demo's tree then predicted 6-16% fast at four of five loads). So, after the speed check,
# STEP_CHECK_STEPS real steps of the chosen tree are timed (after one untimed: a fresh decoder's
# first-use allocations), the way the profile timed the steps its step model was fitted to (a
# random prefix of PREFIX_TOKENS, the passes streamed as the engine streams them, the next tree
# grown ahead where the engine grows it), and compared part by part with the step model as the
# online planner compares an answer's steps (`adaptive.TimingEstimate.observe`): the target side
# (pass, verification, commits) and the draft's levels. Each part's median ratio, to the power
# STEP_CHECK_TRUST, scales that part of every tree (`Timings.scaled`); plain decoding's step keeps
# the speed check's prediction. The power is measured (the 2-vCPU machine, 2026-12-07, the demo's
# (16, 16) tree; computed offline from each load's whole-step ratio): over 34 loads (12 on a
# profile whose fit was about right, 8 on it with its draft reference made 25% slow, 14 on three
# fresh profiles) the answer's steps moved by 0.83 of the check's whole-step ratio (a
# least-squares slope in logs through the origin; correlation 0.77), and the ratio to the power k
# would have predicted them within a mean |log| of 0.075 at k = 0, 0.050 at 0.5, 0.044 at 0.75
# and 0.043 at 1 (root mean square: 0.091, 0.063, 0.056, 0.058; with 6 loads of two more fresh
# profiles, 40: slope 0.89, 0.086, 0.055, 0.045, 0.044). Where the fit was about right the check
# only added noise (0.046 at 0, 0.048 at 0.75); on the fresh profiles (20 loads) it halved the
# error (0.125 at 0, 0.053 at 0.75). It runs only where the chosen tree's step is predicted to
# take at most STEP_CHECK_MAX_S (a 70B target streamed over PCIe takes seconds a pass: its
# answers' own steps are what the online planner learns from), on a profile of this machine, also
# one measured at this load: five profiles measured alone, each then loaded ten times within
# minutes (five with the check), had their step check read a geometric mean of 0.93x (0.80-1.07x,
# 25 loads) and their answers' steps run 0.91x (45 answers) of their own prediction (a profile's
# steps are timed in rounds of six shapes and two modes in turn, an answer's in a run of one
# tree; which difference costs it was not measured). Where a ratio above 1 meets a plain step
# whose constant is very negative, `Timings.plain`'s floor (a quarter of the scaled one-token
# pass) can lift plain decoding's prediction a little: not seen here.
STEP_CHECK_STEPS = 3
STEP_CHECK_MAX_S = 1.0
STEP_CHECK_TRUST = 0.75


@dataclass(frozen=True)
class StepCheck:
    """Real steps of one tree timed at load (`step_check`) against the step model's prediction."""
    budget: int
    depth: int
    greedy: bool
    predicted_s: float  # a step of the tree, by the timings checked (the speed check's rescaled profile)
    measured_s: tuple[float, ...]  # each timed step, whole
    target_ratio: float | None  # the median of the steps' target side, measured over predicted
    draft_ratio: float | None  # ... and of their draft levels (None: none predicted before the pass)
    seconds: float = 0.0  # the check's own cost, its untimed step included

    @property
    def target(self) -> float:
        """The target side's scale: target_ratio ** STEP_CHECK_TRUST, held within CHECK_MAX_SCALE."""
        return _held(self.target_ratio) ** STEP_CHECK_TRUST

    @property
    def draft(self) -> float:
        """The draft levels' scale (1: not read)."""
        return _held(self.draft_ratio) ** STEP_CHECK_TRUST

    def as_dict(self) -> dict:
        return {"budget": self.budget, "depth": self.depth, "greedy": self.greedy,
                "predicted_step_s": self.predicted_s, "measured_step_s": list(self.measured_s),
                "target_ratio": self.target_ratio, "draft_ratio": self.draft_ratio, "target_scale": self.target,
                "draft_scale": self.draft, "seconds": self.seconds}

    def describe(self) -> str:
        measured = statistics.median(self.measured_s)
        parts = [f"target side {self.target_ratio:.2f}x" if self.target_ratio is not None else None,
                 f"draft levels {self.draft_ratio:.2f}x" if self.draft_ratio is not None else None]
        return (f"step check: {len(self.measured_s)} real ({self.budget}, {self.depth}) steps took "
                f"{measured * 1e3:.0f} ms (median; predicted {self.predicted_s * 1e3:.0f}): "
                f"{', '.join(p for p in parts if p)} of the prediction; the trees' steps are rescaled by "
                f"{self.target:.2f}x and {self.draft:.2f}x, plain decoding's is kept ({self.seconds:.1f} s)")


def _held(ratio: float | None) -> float:
    """A ratio held within [1 / CHECK_MAX_SCALE, CHECK_MAX_SCALE] (None: 1, nothing read)."""
    return 1.0 if ratio is None else min(max(ratio, 1 / CHECK_MAX_SCALE), CHECK_MAX_SCALE)


def step_check(engine, timings: Timings, choice, acceptance: AcceptanceVector, greedy: bool = True,
               steps: int = STEP_CHECK_STEPS, max_step_s: float = STEP_CHECK_MAX_S) -> StepCheck | None:
    """`steps` real steps of `choice`'s tree (an optimizer `Choice`, its tree from a table filled
    with `acceptance`) timed on the loaded engine after one untimed, greedy or sampled at T=0.6
    (the profile's two modes), against `timings` (see STEP_CHECK_STEPS above). None: plain
    decoding chosen, no draft, or a step predicted over `max_step_s`."""
    from ..speculation.decoder import SpeculativeDecoder, TreeSpec
    from .adaptive import TimingEstimate
    if engine.draft is None or choice.budget <= 1 or not choice.seconds_per_step <= max_step_s:
        return None
    started = time.perf_counter()
    spec = TreeSpec("sequoia", choice.budget, choice.depth, acceptance=acceptance, parents=choice.tree.parents)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, engine.config.vocab_size, (PREFIX_TOKENS,), generator=g).tolist()
    dec = SpeculativeDecoder(engine.model, engine.draft, spec, SamplingParams(0.0 if greedy else 0.6, 1.0), g,
                             PREFIX_TOKENS + (steps + 1) * (choice.depth + 1) + 16, max_nodes=choice.budget,
                             timed=True, overlap=engine.overlap)
    dec.prefill(ids, engine.max_batch_tokens)
    root, estimate, whole = ids[-1], TimingEstimate(timings), []
    for k in range(steps + 1):
        root = dec.step(root).tokens[-1]
        if k:  # (the first: allocations, no tree grown ahead yet)
            estimate.observe(choice.budget, choice.level_widths, dec.last_times)
            whole.append(dec.last_times.total)
    return StepCheck(choice.budget, choice.depth, greedy, choice.seconds_per_step, tuple(whole),
                     estimate.observed("target"), estimate.observed("draft"), time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def h2d_gbps(nbytes: int, device: torch.device, pinned: bool = True, repeats: int = 5) -> float:
    """Host-to-device copy bandwidth from pinned (or pageable) memory, the median of `repeats`
    copies timed with CUDA events on a stream of their own (the first copy warms up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            dst.copy_(src, non_blocking=pinned)
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:]) / 1e9


def disk_read_gbps(engine, max_bytes: int = 1 << 30) -> float:
    """O_DIRECT read bandwidth of the disk-tier layers (up to `max_bytes` of them), through the
    engine's own reader into a page-aligned buffer."""
    from ..runtime.layer_store import aligned_buffer
    layers = engine.model.layers
    reader, plan = layers.reader, engine.plan
    buf = aligned_buffer(plan.layer_bytes)  # the largest block
    picks = list(plan.disk_layers)[: max(1, max_bytes // plan.layer_bytes)]
    t0 = time.perf_counter()
    moved = sum(reader.read(i, buf) for i in picks)  # each layer's own bytes
    return moved / (time.perf_counter() - t0) / 1e9


class _Repeats:
    """Timings taken again later, one round at a time, between rounds of other work: the median
    of each job's timings (its first, given, and one per `round()`) for every job whose first
    timing is under `long_s` (the rest keep their one). The profile takes the repeats of its
    passes and draft levels in the rounds of its real steps, so that a slow spell of a shared
    machine falls on one round of every job (passes, levels and steps alike) and the medians
    leave it out; taken phase by phase, a spell during
    the passes alone made every pass look slow beside the steps, and the fit then read the
    difference as a per-step constant (-0.10 s on a 0.13 s plain step, 2026-12-03)."""

    def __init__(self, jobs: dict, first: dict, device: torch.device, long_s: float = 0.5):
        self.jobs, self.device = jobs, device
        self.times = {k: [t] for k, t in first.items()}
        self.again = [k for k, t in first.items() if t < long_s]

    def round(self) -> None:
        for k in self.again:
            self.times[k].append(_timed(self.jobs[k], self.device))

    def medians(self) -> dict:
        return {k: statistics.median(v) for k, v in self.times.items()}


# A pass's median can still sit in a slow spell of its own: on the 2-vCPU machine a profile had
# its 64-token pass at 0.357 s beside a 128-token one at 0.370 (2026-12-07 02:26; its other 27
# profiles of the day put the 64-token pass at 0.60-0.75x the 128-token one), and the (64, 8)
# tree was then predicted 16-18% slow in two validations. Timed back to back with its neighbours
# 30 times, the same pass read 0.86-1.16x the line through theirs (a 2-token pass, 1.04-1.44x: a
# shape of its own, not a spell). So a pass whose median is more than BUMP_TOLERANCE off the line
# through its neighbours' medians (linear in width; off by a factor of 1 + BUMP_TOLERANCE either
# way: 1.15x above it or 1/1.15 = 0.87x below) is timed again BUMP_ROUNDS times back to back
# with them, and takes the median ratio of those timings to that line: a spell falls on all three
# of a round alike and cancels in the ratio, and a shape of the pass's own is kept. Limits: each
# width is re-timed once, against its neighbours' medians, so two neighbouring passes slow in the
# same rounds are each only partly mended; a real bend of the curve (flat, then rising) is re-timed
# on every profile and kept (time spent, within the deadline, which is checked before each pass
# re-timed); the re-timed passes' waits for streamed layers join their widths' samples.
BUMP_TOLERANCE = 0.15
BUMP_ROUNDS = 5


def _on_line(a: int, n: int, b: int, ta: float, tb: float) -> float:
    """The time at width n on the line through (a, ta) and (b, tb)."""
    return ta + (tb - ta) * (n - a) / (b - a)


def retime_bumps(jobs: dict, medians: dict, device: torch.device, long_s: float = 1.0,
                 rounds: int = BUMP_ROUNDS, tolerance: float = BUMP_TOLERANCE,
                 deadline: float = math.inf) -> dict[int, float]:
    """Passes off their neighbours' line, timed again (see BUMP_TOLERANCE): `medians` (width ->
    seconds) is corrected in place, the farthest off first, each width at most once, none whose
    pass or neighbours' take `long_s` or more (timed once: seconds each), none begun after
    `deadline` (a perf_counter time); returns the widths re-timed and their medians before."""
    before: dict[int, float] = {}
    while time.perf_counter() < deadline:
        ns = sorted(medians)
        off = []
        for a, n, b in zip(ns, ns[1:], ns[2:]):
            if n in before or max(medians[a], medians[n], medians[b]) >= long_s:
                continue
            miss = abs(math.log(medians[n] / _on_line(a, n, b, medians[a], medians[b])))
            if miss > math.log1p(tolerance):
                off.append((miss, a, n, b))
        if not off:
            break
        _, a, n, b = max(off)
        ratios = []
        for _ in range(rounds):
            ta, tn, tb = (_timed(jobs[k], device) for k in (a, n, b))
            ratios.append(tn / _on_line(a, n, b, ta, tb))
        before[n] = medians[n]
        medians[n] = statistics.median(ratios) * _on_line(a, n, b, medians[a], medians[b])
    return before


def _tree_inputs(n: int, past: int, device: torch.device, generator: torch.Generator, vocab: int):
    """n random tokens as a chain (the mask's shape does not change the work), after `past`."""
    tokens = torch.randint(0, vocab, (n,), generator=generator).to(device)
    mask = torch.cat([torch.ones(n, past, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
    return tokens, torch.arange(past, past + n, device=device), mask.to(device)


def _prefixed_cache(model, prefix: torch.Tensor, room: int):
    """A scratch cache of `model` holding the K/V of `prefix`, with room for `room` more tokens."""
    n = len(prefix)
    cache = model.new_cache(n + room)
    model.forward(prefix.to(model.device), torch.arange(n, device=model.device), cache, logits_rows=slice(0, 0))
    cache.advance(n)
    return cache


def _target_pass_job(target, cache, n: int, g: torch.Generator, vocab: int, executor=None,
                     idles: dict | None = None):
    """One target pass over n new tokens after the cache's prefix (scratch slots, never
    committed), its logits copied to the host; with `executor` and `idles`, the pass's waits for
    streamed layers are recorded under n."""
    tokens, positions, mask = _tree_inputs(n, cache.length, target.device, g, vocab)

    def run():
        before = executor.snapshot().idle_window_seconds if executor is not None else 0.0
        target.forward(tokens, positions, cache, mask=mask).cpu()
        if executor is not None and idles is not None:
            idles.setdefault(n, []).append(executor.snapshot().idle_window_seconds - before)
    run.reading = ("target", n)  # (what it times: tests give the clock a known answer by it)
    return run


def _draft_level_job(draft, dcache, w: int, greedy: bool, g: torch.Generator, dg: torch.Generator, vocab: int):
    """One draft level of w nodes: forward, probabilities, two children drawn for each (as the
    decoder picks every node's children at once, on the device)."""
    tokens, positions, mask = _tree_inputs(w, dcache.length, draft.device, g, vocab)
    params = SamplingParams(0.6, 1.0)  # the sampled path times T=0.6's (the costlier of the two)

    def run():
        logits = draft.forward(tokens, positions, dcache, mask=mask)
        if greedy:
            torch.topk(logits, 2).indices
        else:
            gumbel_top_k(logits_to_probs(logits, params), 2, dg)
    run.reading = ("draft", w, greedy)
    return run


def measure(engine, budget_s: float = DEFAULT_BUDGET_S, progress: bool = True,
            reuse_target: bool = False) -> MeasuredProfile:
    """The machine's profile for the engine's pair. `reuse_target`: take the target's part
    (its passes, their waits, the bandwidth) from a profile of another draft on the same target,
    plan and machine when one was measured (`target_part_path`), and time only the draft's
    levels and the real steps."""
    if engine.draft is None:
        raise UserError("profiling needs a draft (--draft): it measures the draft's level time too")
    started = time.perf_counter()
    shared = _shared_target_part(engine) if reuse_target else None
    device, target, draft = engine.model.device, engine.model, engine.draft
    g = torch.Generator().manual_seed(0)
    max_n = max(TARGET_WIDTHS)
    plan = engine.plan
    bar = tqdm(total=len(TARGET_WIDTHS) + len(DRAFT_WIDTHS) + 2, desc="profiling", unit="step",
               disable=None if progress else True)
    prefix = torch.randint(0, engine.config.vocab_size, (PREFIX_TOKENS,), generator=g)
    widths = [n for n in TARGET_WIDTHS if n <= engine.max_batch_tokens]
    executor = target.layers if plan.streamed_layers and hasattr(target.layers, "snapshot") else None
    if shared is not None:  # another draft's profile on this target, plan and machine measured it
        source, gbps = shared["stream_source"], float(shared["stream_gb_per_s"])
        ns = [n for n in shared["target_tokens"] if n <= engine.max_batch_tokens]
        ts = list(shared["target_pass_s"][:len(ns)])
        idle_s = tuple(shared["target_idle_s"][:len(ns)])
        pass_repeats = None  # (timed when it was measured)
        if shared["check_target_s"] > 0:
            # measured in another spell of the machine than this profile's levels and steps: its
            # check reading taken again scales it to this one, so that the step model is not
            # fitted to the difference between two spells. By the whole ratio, however small (at
            # load, `speed_now` takes half of it: a run lasts minutes, while the steps fitted here
            # are timed within seconds of the reading). One ratio for every width: the other draft's
            # level has no reading of that spell to split the pass's move with (`SpeedCheck.split`)
            r = SpeedCheck._ratio(check_readings(engine, draft=False)[0], shared["check_target_s"])
            if r is not None:
                ts, idle_s = [t * r for t in ts], tuple(t * r for t in idle_s)
        bar.update(1 + len(TARGET_WIDTHS))
    else:
        # 1. streaming bandwidth
        if plan.streamed_layers and device.type == "cuda":
            try:
                source, gbps = "h2d-pinned", h2d_gbps(min(plan.layer_bytes, 256 << 20), device)
            except torch.cuda.OutOfMemoryError:
                raise UserError("profile: no room on the device for a bandwidth test buffer "
                                f"({fmt_bytes(min(plan.layer_bytes, 256 << 20))}); lower --vram") from None
        elif plan.disk_layers:
            source, gbps = "o_direct-read", disk_read_gbps(engine)
        else:
            source, gbps = "none", 0.0
        bar.update(1)
        # 2. the target: a prefix, then passes of n new tokens over it (scratch slots, never committed)
        cache = _prefixed_cache(target, prefix, max_n)

        idles: dict[int, list[float]] = {}  # per width: each timed pass's waits for streamed layers

        def target_pass(n):
            return _target_pass_job(target, cache, n, g, engine.config.vocab_size, executor, idles)

        _timed(target_pass(1), device)  # warm-up: first-touch allocations, kernel selection
        idles.clear()
        # the narrowest and the widest pass first, then the widths between (the most informative
        # first), so that a budget spent early still spans the whole range (the optimizer only
        # searches measured widths, interpolating between them); a pass under 1 s is the median
        # of three, the same rule for every width
        order = [widths[0], widths[-1]] + [n for n in (128, 512, 16, 2, 64, 4, 256, 8, 768, 32) if n in widths[1:-1]]
        target_budget = budget_s * 0.5
        measured: dict[int, float] = {}
        passes = {}
        for n in order:
            if len(measured) >= 2 and time.perf_counter() - started > target_budget:
                break
            passes[n] = target_pass(n)
            measured[n] = _timed(passes[n], device)
            bar.update(1)
        # taken again between the steps' rounds; every pass under a second (the widths a CPU's trees
        # use: a 64-token pass timed once, in a slow spell, had been 0.65 s between 0.25 and 0.78)
        pass_repeats = _Repeats(passes, measured, device, long_s=1.0)
        ns = sorted(measured)
        if ns[-1] < widths[-1]:
            print(f"sequoia-offload: warning: the profile's time budget ({budget_s:g} s) ran out before a "
                  f"{widths[-1]}-token pass; trees above {ns[-1]} nodes will not be considered "
                  "(profile --force --budget-s S measures again)", file=sys.stderr)
    # 3. the draft: one level of w nodes: forward, probabilities, two children drawn for each
    dcache = _prefixed_cache(draft, prefix, max(DRAFT_WIDTHS) + 1)
    dg = g if draft.device.type == "cpu" else torch.Generator(draft.device).manual_seed(0)

    def draft_level(w, greedy):
        return _draft_level_job(draft, dcache, w, greedy, g, dg, engine.config.vocab_size)

    _timed(draft_level(1, False), draft.device)
    levels, first = {}, {}  # (width, greedy) -> the level's run and its first timing
    draft_started = time.perf_counter()
    for w in (1, 256, 16, 64, 4, 128, 32, 8, 2):  # the draft is resident: a tenth of the budget
        if len(first) >= 4 and time.perf_counter() - draft_started > budget_s * 0.1:
            break
        for greedy in (True, False):
            levels[w, greedy] = draft_level(w, greedy)
            first[w, greedy] = _timed(levels[w, greedy], draft.device)
        bar.update(1)
    level_repeats = _Repeats(levels, first, draft.device)
    ws = sorted({w for w, _ in first})

    def bases_now(pass_s: dict | None = None) -> dict:
        """The passes' and levels' medians so far (the passes: `pass_s` where given), as the
        optimizer's base timings, greedy and sampled."""
        tm = pass_s or (pass_repeats.medians() if pass_repeats is not None else dict(zip(ns, ts)))
        dm = level_repeats.medians()
        return {greedy: Timings(tuple(ns), tuple(accumulate((tm[n] for n in ns), max)), tuple(ws),
                                tuple(accumulate((dm[w, greedy] for w in ws), max))) for greedy in (True, False)}

    checks: list[tuple[float | None, float | None]] = []  # the speed check's readings, one per round

    def check_round() -> None:
        # (a target whose first reading was not taken, its pass over CHECK_MAX_PASS_S, is not
        # asked again: each reading would prefill and run a pass of it, seconds for a 70B one)
        checks.append(check_readings(engine, target=not checks or checks[0][0] is not None))

    def repeat_round() -> None:  # one more timing of every short pass and level, between the steps' rounds
        if pass_repeats is not None:
            pass_repeats.round()
        level_repeats.round()
        check_round()

    # 4. real steps of several shapes, greedy and sampled, timed whole: the step model fitted to them
    steps_budget = min(budget_s * 0.2, max(0.0, budget_s - (time.perf_counter() - started)))
    overlap = bool(getattr(engine, "overlap", False)) and executor is not None
    vectors = shaping_vectors(engine)
    shapes, times, ahead = _time_steps(engine, bases_now(), g, steps_budget, pairs=overlap, vectors=vectors,
                                       between=repeat_round)
    retimed: dict[int, float] = {}
    pass_medians = pass_repeats.medians() if pass_repeats is not None else None
    if pass_medians is not None:
        # a pass off its neighbours' line timed again with them, before the step model is fitted
        # to the passes (its error would otherwise be fitted as a constant of every step)
        retimed = retime_bumps(passes, pass_medians, device, deadline=time.perf_counter() + budget_s * 0.1)
    bases = bases_now(pass_medians)
    if pass_medians is not None:
        ts = [pass_medians[n] for n in ns]
        # the waits of the same passes (the median, never more than the pass's own median)
        idle_s = tuple(min(statistics.median(idles[n]), t) for n, t in zip(ns, ts)) if executor is not None else ()
    level_medians = level_repeats.medians()
    dts_greedy, dts = ([level_medians[w, greedy] for w in ws] for greedy in (True, False))
    fits = {greedy: fit_step_model(shapes, times[greedy], bases[greedy], vectors[greedy]) for greedy in (True, False)}
    uses = {greedy: fit_overlap_use(shapes, ahead[greedy], replace(bases[greedy], draft_factor=fits[greedy][2],
                                                                    idle_seconds=idle_s), vectors[greedy])
            if overlap else 0.0 for greedy in (True, False)}
    # the speed check's readings, in this spell (`speed_now` takes them again on every later use):
    # the median of one taken in each round of the steps and one now, as the passes and levels are
    # (one reading alone read 0.77-1.11x the plain step its profile fitted, over the 27 profiles of
    # the 2-vCPU machine's default target on 2026-12-06 and 07, and a later check's ratio moved with it)
    check_round()
    check_t, check_d = (_median_of(r[k] for r in checks) for k in (0, 1))
    bar.update(1)
    bar.close()
    (a_g, b_g, f_g, p_g, cv_g), (a_s, b_s, f_s, p_s, cv_s) = fits[True], fits[False]
    return MeasuredProfile(
        machine=machine_name(device), device=str(device), dtype=str(engine.model.dtype).replace("torch.", ""),
        target=str(engine.folder), target_fingerprint=engine.target_fingerprint or "", draft_key=engine.draft_key or "",
        plan={"resident_layers": len(plan.resident_layers), "ram_layers": len(plan.ram_layers),
              "disk_layers": len(plan.disk_layers), "bytes_per_pass": plan.bytes_per_pass, "buffers": plan.buffers},
        stream_source=source, stream_gb_per_s=gbps, prefix_tokens=PREFIX_TOKENS, target_tokens=tuple(ns),
        target_pass_s=tuple(ts), draft_widths=tuple(ws), draft_level_s=tuple(dts), step_residual_s=a_s,
        draft_level_greedy_s=tuple(dts_greedy), step_residual_greedy_s=a_g,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        measure_s=time.perf_counter() - started, step_per_node_s=b_s, step_per_node_greedy_s=b_g,
        draft_factor=f_s, draft_factor_greedy=f_g, plain_step_s=p_s, plain_step_greedy_s=p_g,
        fit_budgets=tuple(n for n, _ in shapes), fit_depths=tuple(d for _, d in shapes),
        fit_step_s=tuple(t[0] for t in times[False]), fit_step_greedy_s=tuple(t[0] for t in times[True]),
        fit_cv_error=cv_s,
        fit_cv_error_greedy=cv_g, target_idle_s=idle_s, overlap_use=uses[False], overlap_use_greedy=uses[True],
        fit_vector=_own(vectors[False]), fit_vector_greedy=_own(vectors[True]),
        check_target_s=check_t or 0.0, check_draft_s=check_d or 0.0,
        target_retimed=tuple(sorted(retimed)), target_retimed_from_s=tuple(retimed[n] for n in sorted(retimed)))


def _own(vector: AcceptanceVector) -> tuple[float, ...]:
    """A profile's record of the vector that shaped its steps: () for the generic PROFILE_VECTOR."""
    return () if vector == PROFILE_VECTOR else vector.probs


def _time_steps(engine, bases: dict, g: torch.Generator, budget_s: float, pairs: bool = False,
                vectors: dict[bool, AcceptanceVector] | None = None, between=None):
    """Real speculation steps, greedy (bases[True]) and sampled (bases[False]), of the STEP_SHAPES
    the measured widths allow (at least MIN_STEP_SHAPES of them, more while the warm-up round
    stays within a quarter of `budget_s`), then plain steps (PLAIN_STEPS per round). A warm-up round first (untimed: fresh
    cache pages, first-use allocations, a draft catching up), then three timed rounds, each over
    every (mode, shape) in turn (two rounds when the budget is spent after two), so that a slow
    spell of a shared machine falls on one round of each. With `pairs` (the draft grows the next
    tree during the pass) each (mode, shape) runs two steps back to back, both timed: the second
    may start from a tree the first grew ahead (the shape changes between pairs, which drops one).
    Returns the shapes ((1, 1) for plain) and, per mode, for each shape the medians of (whole
    step, draft part, target part), and each timed step's levels grown ahead (in run order).
    vectors: per mode (greedy True), the vector that shapes its trees (PROFILE_VECTOR by default).
    between: called before each of the first two timed rounds (the profile's passes and levels
    timed again there, in the same spell as the steps)."""
    vectors = vectors or {True: PROFILE_VECTOR, False: PROFILE_VECTOR}
    from ..speculation.decoder import SpeculativeDecoder, TreeSpec
    widest = bases[True].target_tokens[-1]
    fits = [(n, d) for n, d in STEP_SHAPES if n <= widest and n <= engine.max_batch_tokens]
    per_shape = 2 if pairs else 1
    capacity = PREFIX_TOKENS + 5 * per_shape * sum(d + 1 for _, d in fits) + 4 * PLAIN_STEPS + 16
    ids = torch.randint(0, engine.config.vocab_size, (PREFIX_TOKENS,), generator=g).tolist()
    decs, roots = {}, {}
    for greedy in (True, False):
        decs[greedy] = SpeculativeDecoder(engine.model, engine.draft, TreeSpec(),
                                          SamplingParams(0.0 if greedy else 0.6, 1.0), g, capacity,
                                          max_nodes=max([n for n, _ in fits] + [1]), timed=True,
                                          overlap=engine.overlap)  # (passes as the engine runs them)
        decs[greedy].prefill(ids, engine.max_batch_tokens)
        roots[greedy] = ids[-1]
    device = engine.model.device

    def one_step(greedy, n, d):
        dec = decs[greedy]
        dec.set_spec(TreeSpec("sequoia", n, d, acceptance=vectors[greedy]) if n > 1 else TreeSpec())
        whole = _timed(lambda: roots.__setitem__(greedy, dec.step(roots[greedy]).tokens[-1]), device)
        t = dec.last_times  # a tree step after the plain one first catches the draft up: not its cost
        return whole - t.catch_up, t.draft - t.catch_up, t.target, t.ahead_levels

    started = time.perf_counter()
    spent_between = 0.0  # (the repeats taken between rounds do not count against the steps' budget)
    shapes = []
    for k, (n, d) in enumerate(fits):  # the warm-up round picks the shapes
        if k >= MIN_STEP_SHAPES and time.perf_counter() - started > budget_s / 4:
            break
        shapes.append((n, d))
        for greedy in (True, False):
            for _ in range(per_shape):
                one_step(greedy, n, d)
    shapes.append((1, 1))
    for greedy in (True, False):
        one_step(greedy, 1, 1)
    runs = {(greedy, shape): [] for greedy in (True, False) for shape in shapes}
    for r in range(3):
        if r == 2 and time.perf_counter() - started - spent_between > budget_s * per_shape:
            break
        if between is not None and r < 2:
            t_between = time.perf_counter()
            between()
            spent_between += time.perf_counter() - t_between
        for shape in shapes:
            for greedy in (True, False):
                for _ in range(per_shape if shape[0] > 1 else PLAIN_STEPS):
                    runs[greedy, shape].append(one_step(greedy, *shape))
    # a step that started from levels grown ahead is counted at what it would have cost without
    # them (whole and draft part): the step model's draft work; the overlap is fitted apart
    times = {greedy: [tuple(statistics.median(x[i] + (_saved(bases[greedy], shape, x[3], vectors[greedy])
                                                      if i < 2 else 0.0)
                                              for x in runs[greedy, shape]) for i in range(3))
                      for shape in shapes] for greedy in (True, False)}
    ahead = {greedy: [[x[3] for x in runs[greedy, shape]] for shape in shapes] for greedy in (True, False)}
    return shapes, times, ahead


def _saved(base: Timings, shape: tuple[int, int], ahead_levels: int,
           vector: AcceptanceVector = PROFILE_VECTOR) -> float:
    """The draft time a step did not pay because its first `ahead_levels` levels were grown
    during the pass before it: those levels (of the tree `vector` shapes) at the profile's level times."""
    if not ahead_levels:
        return 0.0
    return sum(base.draft(w) for w in step_widths(vector, *shape)[:ahead_levels])


def fit_overlap_use(shapes: list[tuple[int, int]], ahead: list[list[int]], base: Timings,
                    vector: AcceptanceVector = PROFILE_VECTOR) -> float:
    """The share of the draft work that fits in a pass's waits which the next step used
    (`Timings.overlap_use`), from the timed tree steps that followed a step of their own shape
    (the second of each pair; `ahead`: each step's levels grown ahead, in pairs): the draft
    time they saved (`_saved`) over the draft work `base` says could have been grown during
    the pass before (min(the tree's draft work, base.idle(n))). 0 when no pass waits. `vector`
    shaped the timed trees."""
    saved = room = 0.0
    for (n, d), levels in zip(shapes, ahead):
        if n == 1:
            continue
        work = base.draft_factor * sum(base.draft(w) for w in step_widths(vector, n, d))
        for second in levels[1::2]:  # (the levels at what a step pays for them: f times their own)
            saved += base.draft_factor * _saved(base, (n, d), second, vector)
            room += min(work, base.idle(n))
    return min(1.0, saved / room) if room > 0 else 0.0


def fit_step_model(shapes: list[tuple[int, int]], times: list[tuple[float, float, float]],
                   base, vector: AcceptanceVector = PROFILE_VECTOR) -> tuple[float, float, float, float, float]:
    """(a, b, f, plain, cv error) of the step model fitted to measured steps, each given as
    (whole, draft part, target part) seconds. A tree step of n nodes in levels of widths w costs
    base.target(n) + f * D + a + b * n, D = sum(base.draft(w)); each part is fitted on its own by
    least squares (better conditioned than one fit of the whole): the draft part as f * D, the
    target part (pass and verification; the loader's prefetch during the draft shows here) as
    base.target(n) + a_t + b * n (a_t alone: the median), the rest (commits) as a constant;
    a = a_t + the rest. Which terms the target part gets (a_t and b, a_t alone, neither; b needs
    four tree shapes, three to fit and one left out) is chosen by cross-validation (STEP_TERMS):
    four or five shapes, each a median of three timings on a shared machine, do not always carry
    a per-node slope, and one slow pass among the isolated ones made a fitted b of -1.8 ms/node
    that cut a (16, 4) step by 20% (validate_simulator run 9). A plain step costs
    base.target(1) + plain. The cv error is the mean of |predicted / measured - 1| of the whole
    tree steps, each predicted from a fit to the other shapes (0 with fewer than two), of the
    terms chosen. `vector` shaped the timed trees (their level widths)."""
    import numpy as np
    rows = []  # (n, D, whole, draft part, target part)
    for (n, d), t in zip(shapes, times):
        if n > 1:
            rows.append((n, sum(base.draft(w) for w in step_widths(vector, n, d)), *t))
    plain = [t[0] - base.target(1) for (n, _), t in zip(shapes, times) if n == 1]

    def solve(sub, terms):
        if not sub:
            return 0.0, 0.0, 1.0
        n, dm, whole, dpart, tpart = (np.array([r[i] for r in sub], dtype=np.float64) for i in range(5))
        f = float(min(max((dm @ dpart) / max(dm @ dm, 1e-30), 0.0), 3.0))
        y = tpart - np.array([base.target(int(x)) for x in n])
        if terms == "constant and per node":
            a_t, b = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), y, rcond=None)[0]
        else:
            a_t, b = (float(np.median(y)) if terms == "constant" else 0.0), 0.0  # (one outlier moves no median)
        return float(a_t + np.mean(whole - dpart - tpart)), float(b), f

    def cv_error(terms):
        errors = []
        for k, (n, dm, whole, _, _) in enumerate(rows):
            a, b, f = solve(rows[:k] + rows[k + 1:], terms)
            predicted = max(0.25 * base.target(n), base.target(n) + f * dm + a + b * n)  # as Timings.step
            errors.append(abs(predicted / whole - 1))
        return float(np.mean(errors))

    usable = [t for t in STEP_TERMS if t != "constant and per node" or len(rows) >= 4]  # (3 to fit, 1 left out)
    if len(rows) >= 2:
        scores = {t: cv_error(t) for t in usable}
        terms = min(usable, key=lambda t: (scores[t], usable.index(t)))
        cv = scores[terms]
    else:
        terms, cv = ("constant" if rows else "none"), 0.0
    a, b, f = solve(rows, terms)
    return a, b, f, float(np.median(plain)) if plain else 0.0, cv

