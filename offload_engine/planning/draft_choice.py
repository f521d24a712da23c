"""`--draft auto`: the optimizer chooses the draft too (the default when --draft is not given).

The candidates are the drafts at hand without a download:
  * the self-drafts: the substitute ones `self-q8` / `self-q4` (the target's own resident layers,
    a quantised copy of each streamed one, the target's KV cache) and the full `self-int8` /
    `self-int4` (every layer quantised, a cache of their own);
  * `default`: the committed distilled draft of the embedded default target (other targets
    cannot use it: the plan refuses it, and the table says why);
  * models with the target's vocabulary found beside the target (sibling checkpoint folders that
    `models` pairs with it: the same vocabulary, at most a quarter of its parameters) or
    named with `draft_candidates` (`--draft-candidates A,B`);
  * `none`: plain streamed decoding.
A candidate the memory budget cannot hold beside the target's plan is dropped with the planner's
reason. Each other one is loaded as `--tree auto` loads it: its profile (the target's passes,
shared by every draft on the plan, its own level times, and the step model fitted to its real
steps) and its acceptance vectors, each measured once per machine / pair and cached, give the
optimizer's best tree and its predicted s/token at T=0 and T=0.6. Each profile times its own
plain steps in the same rounds as its trees, so a candidate's speed-up over plain decoding is
measured within one spell of the machine, while two profiles taken minutes apart can see plain
decoding itself 0.10 and 0.15 s/token apart (the 2-vCPU machine, 2026-12-03). So the candidates
whose target plan is the same (the same plain decoding) are put on one scale (`pool_plain`): their
plain time is the median of their profiles', and each one's predicted s/token is its own
speed-up applied to it; `none` is the fastest plan's plain time. Each candidate is predicted
for generations of LENGTHS tokens too (a deep tree's last step in a short answer throws away
what it accepted past the end, so a short answer can favour a shallower draft or none:
`optimizer`), the length between two of them interpolated in 1/length. The engine then loads
the one predicted fastest (at the request temperature when known, else over both; for the
requests' max_new_tokens when known, else for long generations). The `suffix` draft
is not a candidate: what it gains depends on text repeating, which nothing measured before the
text predicts (it is listed, with that reason); `--draft suffix` or `X+suffix` choose it.

The table is cached in <cache>/draft-choice/, keyed by the target, the machine and the placement
flags, and trusted only while every candidate's profile it was computed from is still cached
(a profile measured again re-chooses) and its pair's acceptance vectors, stored or cached, are
the files it was planned from, byte for byte (vectors re-measured, a pull that brings new ones
or a quick measurement's cache cleared re-choose). `sequoia-offload plan --draft auto` prints it.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from ..fsutil import atomic_write_text, cache_root

SELF_CANDIDATES = ("self-q8", "self-q4", "self-int8", "self-int4")
TEMPERATURES = (0.0, 0.6)
CHOICE_VERSION = 5  # 2: plain decoding pooled over the candidates of one plan (`pool_plain`); 3: by length;
# 4: a step's floor, the pass's compute and the draft's work (`Timings.step`); 5: the acceptance
# vectors' digests (`vector_digests`)
# between answers, another candidate replaces the loaded draft (`switch_target`) when its speed-up
# over plain decoding is this much above what the loaded one's planner has learned it makes here
SWITCH_MARGIN = 0.15
SWITCH_MIN_STEPS = 24  # ... once the loaded draft has decoded this many steps since it was loaded
LENGTHS = (16, 32, 64, 128, 256, 512, 1024)  # answer lengths (max_new_tokens) each candidate is predicted for
DRAFT_RATIO = 0.25  # a draft has at most this fraction of its target's parameters (also `models`)


@dataclass
class Candidate:
    name: str  # the --draft value ("none": no draft)
    predicted: dict = field(default_factory=dict)  # temperature -> predicted s/token (long generations)
    by_length: dict = field(default_factory=dict)  # temperature -> {length: [s/token, tree]} for LENGTHS
    plain: dict = field(default_factory=dict)  # temperature -> plain streamed decoding, predicted (pooled)
    plain_measured: dict = field(default_factory=dict)  # temperature -> plain as its own profile measured it
    plan: str = ""  # the target's plan it ran on (resident/RAM/disk layers, bytes a pass): plain's own
    trees: dict = field(default_factory=dict)  # temperature -> "(n,d)" or "plain"
    dropped: str = ""  # why it is not a candidate (memory, vocabulary, ...); "" when it is
    profile: str = ""  # the profile file its timings came from
    measured_at: str = ""  # that profile's own time stamp (measured again: the choice is made again)
    pair: list = field(default_factory=list)  # [target fingerprint, draft key]: whose acceptance vectors
    vectors: dict = field(default_factory=dict)  # the pair's vector files it was planned from -> their digests

    def score(self, temperature: float | None, length: int | None = None) -> float:
        """Predicted s/token at the temperature (the nearest measured), or the mean over both;
        for generations of `length` tokens (None: long ones)."""
        if self.dropped or not self.predicted:
            return math.inf
        if temperature is None:
            return sum(self.at(t, length)[0] for t in self.predicted) / len(self.predicted)
        return self.at(self.nearest(temperature), length)[0]

    def nearest(self, temperature: float) -> float:
        return min(self.predicted, key=lambda k: (abs(float(k) - temperature), float(k)))

    def at(self, t: float, length: int | None) -> tuple[float, str]:
        """(s/token, tree) at the measured temperature t for `length` tokens: between two of
        LENGTHS (or the longest and a long generation) linear in 1/length, the tree of the
        nearer; a length under the shortest takes the shortest's."""
        long = (self.predicted[t], self.trees.get(t, "plain"))
        table = {int(k): v for k, v in self.by_length.get(t, {}).items()}
        if length is None or not table:
            return long
        points = sorted(table.items()) + [(math.inf, list(long))]
        if length <= points[0][0]:
            return tuple(points[0][1])
        for (l0, (s0, tree0)), (l1, (s1, tree1)) in zip(points, points[1:]):
            if l0 <= length <= l1:
                x0, x1, x = 1 / l0, 1 / l1, 1 / length  # (1/inf = 0)
                w = (x0 - x) / (x0 - x1)
                return s0 + w * (s1 - s0), (tree1 if w >= 0.5 else tree0)
        return long


@dataclass
class DraftChoice:
    candidates: list[Candidate]
    chosen: str
    temperature: float | None
    length: int | None = None  # the answers' tokens (max_new_tokens) it was chosen for (None: long ones)
    # the chosen draft's loaded engine's `Engine.plan_for` (`refresh`): the summary says what its plans predict
    plan_for: object = field(default=None, repr=False, compare=False)

    @property
    def best(self) -> Candidate:
        return next(c for c in self.candidates if c.name == self.chosen)

    def speedup(self, temperature: float | None = None) -> float:
        """The chosen draft's predicted speed-up over plain streamed decoding."""
        c = self.best
        if not c.plain:
            return 1.0
        plain = Candidate("plain", predicted=c.plain)
        return plain.score(temperature) / c.score(temperature, self.length)

    def refresh(self, engine) -> None:
        """The chosen candidate's predictions as its loaded engine makes them now (a cached
        table's are from when it was chosen; the engine's profile has had its speed check since,
        `profiler.speed_now`), kept on the table's pooled scale of plain decoding; the summary
        and the engine's stats line then say the same for long answers and for the table's
        LENGTHS (between two of those the summary interpolates, the engine plans the length
        itself). The other candidates keep the table's figures."""
        c = self.best
        if c.name == "none" or not engine.auto_plans:
            return
        self.plan_for = engine.plan_for
        pooled = dict(c.plain)
        _fill(c, engine)
        for t, own in c.plain_measured.items():
            if t in pooled and own > 0:
                c.predicted[t] *= pooled[t] / own
                for entry in c.by_length.get(t, {}).values():
                    entry[0] *= pooled[t] / own
                c.plain[t] = pooled[t]

    def summary(self, temperature: float | None = None) -> str:
        """One line: the draft chosen, its tree and its predicted speed-up; its s/token as its
        own profile predicts it (as the loaded engine's stats line will), not on the table's
        pooled scale."""
        c = self.best
        t = temperature if temperature is not None else self.temperature
        count = sum(1 for x in self.candidates if not x.dropped)
        if self.plan_for is not None:  # (the loaded engine's plan: its length may be its learned answers')
            return (f"draft auto: {c.name}, {self.plan_for(t or 0.0).line()} "
                    f"({count} candidates; `plan --draft auto` lists them)")
        key = min(c.trees, key=lambda k: abs(float(k) - (t or 0.0))) if c.trees else None
        tree = c.at(key, self.length)[1] if key is not None else "plain"
        own = c.score(t, self.length) * (c.plain_measured[key] / c.plain[key]
                                         if key in c.plain_measured and c.plain.get(key) else 1.0)
        span = f" for {self.length}-token answers" if self.length is not None else ""
        return (f"draft auto: {c.name}, tree {tree}, {own:.3f} s/token predicted{span}, "
                f"{self.speedup(t):.2f}x over plain streamed decoding "
                f"({sum(1 for x in self.candidates if not x.dropped)} candidates; `plan --draft auto` lists them)")

    def table(self) -> str:
        temps = sorted({float(k) for c in self.candidates for k in c.predicted}) or list(TEMPERATURES)
        span = f" ({self.length} tokens)" if self.length is not None else ""
        head = ("| draft | " + " | ".join(f"T={t:g}: tree, s/token{span}" for t in temps)
                + " | speed-up over plain | |")
        lines = [head, "|---|" + "---|" * len(temps) + "---:|---|"]
        for c in sorted(self.candidates, key=lambda c: (c.score(self.temperature, self.length), c.name)):
            if c.dropped:
                lines.append(f"| {c.name} | " + " | ".join("-" for _ in temps) + f" | - | dropped: {c.dropped} |")
                continue
            cells = []
            for t in temps:
                seconds, tree = c.at(c.nearest(t), self.length)
                cells.append(f"{tree}, {seconds:.3f}")
            plain = Candidate("plain", predicted=c.plain).score(self.temperature) if c.plain else math.nan
            mark = "**chosen**" if c.name == self.chosen else ""
            lines.append(f"| {c.name} | " + " | ".join(cells)
                         + f" | {plain / c.score(self.temperature, self.length):.2f}x | {mark} |")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"version": CHOICE_VERSION, "chosen": self.chosen, "temperature": self.temperature,
                           "candidates": [asdict(c) for c in self.candidates]}, indent=2) + "\n"


def candidate_names(target_folder: Path, embedded_default: bool, extra: list[str] | None) -> list[str]:
    """The drafts to consider, in the order the table is built (ties go to the earlier)."""
    names = list(SELF_CANDIDATES)
    if embedded_default:
        names.append("default")
    names += [str(x) for x in (extra or [])]
    names += [str(p) for p in siblings(target_folder) if str(p) not in names]
    return names + ["suffix", "none"]


def parameters(cfg) -> int:
    """A model's parameters, from its config (embeddings, head, norms and every layer)."""
    from ..formats.checkpoint import global_shapes
    from .simulator import layer_params
    return sum(math.prod(s) for s in global_shapes(cfg).values()) + cfg.num_layers * layer_params(cfg)


def vocab_digest(folder: Path) -> str:
    """A digest of a checkpoint's vocabulary (tokens and added tokens): equal digests can
    speculate together; "" when its tokenizer.json does not read."""
    try:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        added = sorted((a["id"], a["content"]) for a in data.get("added_tokens", []))
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    blob = json.dumps([sorted(vocab.items()) if isinstance(vocab, dict) else vocab, added])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def siblings(target_folder: Path) -> list[Path]:
    """Checkpoint folders beside the target that `models` would pair with it as drafts: the
    same vocabulary (`vocab_digest` and vocab_size) and at most DRAFT_RATIO of its parameters."""
    from ..formats.config import load_config
    try:
        digest, cfg = vocab_digest(target_folder), load_config(target_folder)
        entries = sorted(target_folder.parent.iterdir())
    except (OSError, UserError):
        return []
    found = []
    for p in entries:
        if not digest or p == target_folder or not (p / "config.json").is_file():
            continue
        try:
            other = load_config(p)
        except (OSError, UserError):
            continue
        if (vocab_digest(p) == digest and other.vocab_size == cfg.vocab_size
                and parameters(other) <= DRAFT_RATIO * parameters(cfg)):
            found.append(p)
    return found


def _key(folder: Path, kwargs: dict) -> str:
    from ..formats.checkpoint import fingerprint
    from .profiler import PROFILE_VERSION, machine_name
    import torch
    device = kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    # (a new profile version puts every profile under a new key: the table, made from the old
    # ones, whose files stay behind, is made again from new ones)
    ident = [CHOICE_VERSION, PROFILE_VERSION, fingerprint(folder), machine_name(torch.device(device)),
             {k: str(v) for k, v in sorted(kwargs.items()) if k != "progress"}]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def choice_path(folder: Path, kwargs: dict, extra: list[str] | None) -> Path:
    return cache_root() / "draft-choice" / f"{folder.name}-{_key(folder, {**kwargs, 'candidates': extra})}.json"


def _cached(path: Path, temperature: float | None, length: int | None = None) -> DraftChoice | None:
    """The cached table, when it reads whole and every profile it used is still there."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != CHOICE_VERSION:
            return None
        cands = [Candidate(**{**c, **{f: {float(k): v for k, v in c[f].items()}
                                      for f in ("predicted", "plain", "plain_measured", "trees", "by_length")}})
                 for c in data["candidates"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None  # unreadable or of another form: chosen again
    if any(c.profile and _measured_at(c.profile) != c.measured_at for c in cands):
        return None  # a profile gone or measured again since
    try:
        if any(c.pair and vector_digests(*c.pair) != c.vectors for c in cands):
            return None  # the pair's acceptance vectors re-measured, added or gone since
    except (TypeError, ValueError):
        return None  # a pair of another form: chosen again
    return _pick(cands, temperature, length)


def vector_digests(target_fp: str | None, dkey: str | None) -> dict:
    """The pair's acceptance vectors (stored in the repo or cached: `known_vectors`), by temperature
    and file name (not the folder: two checkouts sharing one cache read the same table), with the
    sha256 of each one's bytes."""
    from ..speculation.acceptance_store import known_vectors
    out = {}
    for t, (_, path) in sorted(known_vectors(target_fp, dkey).items()):
        try:
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        except OSError:
            digest = ""
        out[f"{t:g} {Path(path).name}"] = digest
    return out


def _measured_at(profile: str) -> str | None:
    try:
        return json.loads(Path(profile).read_text(encoding="utf-8")).get("measured_at")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def pool_plain(cands: list[Candidate]) -> None:
    """Put the measured candidates of one target plan on one scale of plain decoding (see the
    module's docstring), in place: per plan and temperature, plain is the median of their
    profiles' plain times, and each candidate's predicted s/token keeps its own speed-up over
    its own profile's plain (predicted * pooled / own). `none` gets the fastest plan's plain."""
    groups: dict[str, list[Candidate]] = {}
    for c in cands:
        if c.name != "none" and not c.dropped and c.plain_measured:
            groups.setdefault(c.plan, []).append(c)
    fastest: dict[float, float] = {}
    for group in groups.values():
        for t in {t for c in group for t in c.plain_measured}:
            pooled = statistics.median(c.plain_measured[t] for c in group if t in c.plain_measured)
            fastest[t] = min(fastest.get(t, math.inf), pooled)
            for c in group:
                if t in c.plain_measured and t in c.predicted:
                    c.predicted[t] *= pooled / c.plain_measured[t]
                    for entry in c.by_length.get(t, {}).values():
                        entry[0] *= pooled / c.plain_measured[t]
                    c.plain[t] = pooled
    none = next(c for c in cands if c.name == "none")
    if fastest:
        none.predicted = dict(sorted(fastest.items()))
        none.plain, none.trees = dict(none.predicted), {t: "plain" for t in none.predicted}
        none.by_length = {}  # (plain decoding wastes nothing: its s/token is the same at every length)


def _pick(cands: list[Candidate], temperature: float | None, length: int | None = None) -> DraftChoice:
    """The candidate predicted fastest for `length`-token generations (ties: the earlier); a
    draft whose best tree is plain decoding at every temperature would only hold memory: `none`
    stands for it."""
    def useful(c: Candidate) -> bool:
        trees = [c.at(t, length)[1] for t in c.predicted]
        return not c.dropped and (c.name == "none" or any(v != "plain" for v in trees))
    best = min((c for c in cands if useful(c)), key=lambda c: c.score(temperature, length), default=None)
    if best is None or not math.isfinite(best.score(temperature, length)):
        best = next(c for c in cands if c.name == "none")
    return DraftChoice(cands, best.name, temperature, length)


def choose_draft(folder: Path, embedded: bool, load_kwargs: dict, *, load, plan,
                 temperature: float | None = None, extra: list[str] | None = None, progress: bool = True,
                 force: bool = False, budgets: dict | None = None, length: int | None = None) -> DraftChoice:
    """The table of candidates and the one to load (see the module's docstring), for the target
    checkpoint `folder` (`embedded`: the embedded default, which has a committed draft).
    `load_kwargs`: Engine.load's placement and tree flags as given (device, dtype, offload, vram,
    ram, buffers, weights, max_context, draft_group_size, cache_slots, tree_budget, tree_depth,
    verify_reads, overlap): the cache's key. `load` and `plan`: Engine.load and plan_only (the
    engine sits above this layer and hands them down: `engine.choose_draft`). `budgets`: vram and
    ram resolved once (the free memory before the first candidate), so that every candidate, and
    then the one loaded, is planned alike. `length`: the answers' tokens to choose for (the
    requests' max_new_tokens; None: long generations; the table holds every length)."""
    import gc

    import torch

    from .profiler import profile_path
    path = choice_path(folder, load_kwargs, extra)
    if not force and path.exists():
        found = _cached(path, temperature, length)
        if found is not None:
            return found
    plan_keys = ("device", "dtype", "max_context", "offload", "vram", "ram", "buffers", "draft_group_size",
                 "cache_slots", "weights")
    given = {**load_kwargs, **(budgets or {})}
    cands = []
    for name in candidate_names(folder, embedded, extra):
        c = Candidate(name)
        cands.append(c)
        if name == "suffix":
            c.dropped = "its gain depends on repeated text, which no measurement predicts (--draft suffix)"
            continue
        if name == "none":
            continue
        try:
            plan(folder, draft=name, **{k: given[k] for k in plan_keys if k in given})
        except UserError as e:
            c.dropped = str(e).replace("\n", " ")
            continue
        if progress:
            print(f"sequoia-offload: draft auto: evaluating --draft {name}", file=sys.stderr)
        engine = None
        try:
            engine = load(folder, draft=name, tree="auto", adapt=False, progress=progress, **given)
            _fill(c, engine)
            p = engine.plan
            c.plan = (f"{len(p.resident_layers)} resident, {len(p.ram_layers)} RAM, {len(p.disk_layers)} disk layers, "
                      f"{p.bytes_per_pass} B a pass")
            c.profile = str(profile_path(engine))
            c.measured_at = _measured_at(c.profile) or ""
            c.pair = [engine.target_fingerprint, engine.draft_key]
            c.vectors = vector_digests(*c.pair)
        except (UserError, RuntimeError, MemoryError) as e:  # (CUDA's out of memory is a RuntimeError)
            c.dropped = str(e).replace("\n", " ")[:300]
            c.predicted, c.plain, c.plain_measured, c.trees, c.by_length = {}, {}, {}, {}, {}
        finally:
            if engine is not None:
                engine.close()
            del engine  # its memory back before the next candidate is planned
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    pool_plain(cands)
    choice = _pick(cands, temperature, length)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, choice.to_json())
    return choice


def _fill(c: Candidate, engine) -> None:
    """A candidate's predictions (its own profile's scale) from its loaded engine's auto plans."""
    c.predicted, c.plain, c.trees, c.by_length = {}, {}, {}, {}
    for t, auto in engine.auto_plans.items():
        long = auto.for_length(None).choice  # (an engine loaded for one length: long generations here)
        c.predicted[t] = long.seconds_per_token
        c.plain[t] = auto.plain_seconds_per_token
        c.trees[t] = _tree(long)
        c.by_length[t] = {}
        for n in LENGTHS:  # (the steps make the tokens after the prefill's first)
            at = auto.for_length(n - 1).choice
            c.by_length[t][n] = [at.seconds_per_token, _tree(at)]
    c.plain_measured = dict(c.plain)


def _tree(choice) -> str:
    return "plain" if choice.budget == 1 else f"({choice.budget},{choice.depth})"


def adapted_speedup(planner, length: int | None) -> float:
    """The speed-up over plain decoding that a draft's planner predicts for its next answer of
    `length` step tokens from what it learned in this run (`OnlinePlanner.outlook`)."""
    return planner.outlook(length)


def switch_wait(switches: int) -> int:
    """The steps the loaded draft decodes before a switch is considered, after `switches` switches
    in this run: SWITCH_MIN_STEPS, doubled by each switch (answers at two temperatures that favour
    two drafts make at most a few switches, not one every other answer)."""
    return SWITCH_MIN_STEPS * 2 ** min(switches, 16)


def switch_target(choice: DraftChoice, current: str, speedup: float, temperature: float, length: int | None,
                  steps: int, kept: dict, min_steps: int | None = None,
                  exclude: set | frozenset = frozenset()) -> tuple[str, float] | None:
    """The candidate to load in place of `current` before the next answer, with its speed-up,
    or None: once `current` has decoded `min_steps` steps (`switch_wait`), the candidate on the same target
    plan (the same placement: it fits where `current` is) with the highest speed-up over plain
    decoding, when that is SWITCH_MARGIN above `speedup`, what `current` is predicted to make
    from what this run measured (at least plain decoding's 1.0, which its planner can always
    fall back on). A candidate this run has used before counts with what it learned then
    (`kept`: name -> its adapted speed-up), the others with the table's prediction at the
    request's temperature and for answers of `length` tokens. `none` and `suffix` are never
    switched to (plain decoding is the planner's own fallback), nor those in `exclude` (a switch
    to them failed in this run)."""
    if steps < (SWITCH_MIN_STEPS if min_steps is None else min_steps):
        return None
    mine = next((c for c in choice.candidates if c.name == current), None)
    if mine is None:
        return None
    best = None
    for c in choice.candidates:
        if (c.name in (current, "none", "suffix") or c.name in exclude or c.dropped or not c.predicted
                or c.plan != mine.plan):
            continue
        if c.name in kept:
            value = kept[c.name]
        else:
            t = c.nearest(temperature)
            value = c.plain[t] / c.score(temperature, length) if c.plain.get(t) else 1.0
        if best is None or value > best[1]:
            best = (c.name, value)
    if best is not None and best[1] > max(1.0, speedup) * (1 + SWITCH_MARGIN):
        return best
    return None
