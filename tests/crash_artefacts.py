"""The operations tests/crash_harness.py interrupts, one per artefact, each through the product's
own entry point, with what a correct next run must show (not collected by pytest).

Importing this module imports offload_engine (and torch) but runs no torch op: the harness forks
its children after it.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import gguf  # noqa: F401 - everything the operations import, imported once here before the children fork
import jinja2  # noqa: F401
import safetensors.torch  # noqa: F401
import tokenizers  # noqa: F401
import torch
import torch._dynamo  # noqa: F401 - what torch.optim's first optimizer imports (seconds)
import uvicorn  # noqa: F401
import uvicorn.lifespan.on  # noqa: F401
import uvicorn.loops.auto  # noqa: F401
import uvicorn.protocols.http.auto  # noqa: F401
import uvicorn.protocols.websockets.auto  # noqa: F401

import offload_engine.apps.server  # noqa: F401
import offload_engine.engine  # noqa: F401
import offload_engine.planning.auto_tree  # noqa: F401
from offload_engine.apps.cli import main as cli_main
from offload_engine.apps.distill import DistillOptions, distill, work_dir
from offload_engine.errors import UserError
from offload_engine.formats import gguf_model, gguf_native
from offload_engine.formats.checkpoint import open_checkpoint
from offload_engine.formats.config import load_config
from offload_engine.fsutil import cache_root
from offload_engine.planning import profiler
from offload_engine.planning.hw_profile import load_measured
from offload_engine.planning.profiler import read_target_part
from offload_engine.planning import learned
from offload_engine.speculation import measure
from sequoia_trees.acceptance import AcceptanceVector
from offload_engine.runtime.layer_store import open_or_build
import offload_engine.speculation.drafts as drafts

LABELS = {"models": "sidecar", "stores": "layer store", "drafts": "default draft", "profiles": "profile",
          "acceptance": "acceptance vectors", "native": "native library", "learned": "learned acceptance"}
# a tiny distillation: two generation batches, about 20 training steps, saved every 3
DISTILL = dict(layers=1, tokens=200, gen_tokens=80, max_answer_tokens=12, batch_size=2, gen_batch=4,
               val_sequences=3, eval_every=4, save_every=3, lr=3e-3, save_dtype="float32", offload="none")
# serve's --tree auto measures the machine (profiler.DEFAULT_BUDGET_S, 120 s at most) and the pair's
# vectors (4 prompts of the shipped list x 24 tokens) on first use: cut to a tiny model's share here
# (1 prompt of the test's list x 8 tokens); the code path is the same
PROFILE_BUDGET_S, SERVE_AUTO_PROMPTS, SERVE_AUTO_NEW_TOKENS = 0.3, 1, 8
SERVE_FLAGS = ["--draft", "default", "--offload", "disk", "--tree-budget", "16", "--tree-depth", "4"]
PROMPT = {"prompt": "The capital of France", "max_tokens": 8, "temperature": 0}


def prebuild_native() -> None:
    """The compiled GGUF dequantizer, built (or found) in the harness's own cache and loaded in
    the harness, so that no child compiles it (runs no torch op)."""
    gguf_native.available()


def _timings_blind(data: bytes) -> bytes:
    """A measured file compared by its fields, not its timings: the sorted keys of its JSON."""
    try:
        return json.dumps(sorted(json.loads(data))).encode()
    except (ValueError, TypeError):
        return b"unparseable: " + data


class Artefact:
    name, server, out_label = "", False, "out"

    def prepare(self, ctx) -> None:
        (ctx.live / "cache").mkdir()
        (ctx.live / "out").mkdir()

    def op(self, ctx, first: bool):
        raise NotImplementedError

    def check(self, ctx, run, ref, post: dict) -> list[str]:
        if run.status != 0:
            return [f"exit status {run.status}: {run.log[-800:]}"]
        return [] if run.result == ref.result else [f"result {run.result!r}, uninterrupted {ref.result!r}"]

    def validate(self, ctx, unit: str) -> list[str]:
        return []

    def normalise(self, rel: str, data: bytes) -> bytes:
        return data

    def label(self, unit: str) -> str:
        parts = unit.split(os.sep)
        if parts[0] == "cache" and len(parts) > 2:
            return LABELS.get(parts[2], parts[2])
        return self.out_label + (" (work folder)" if unit.endswith(".partial") else "")

    def query(self, ctx):
        return None


class Sidecar(Artefact):
    """The GGUF metadata folder the default model is read through (`gguf_model.sidecar_for`)."""
    name = "sidecar"

    def op(self, ctx, first):
        return str(gguf_model.sidecar_for(Path(ctx.fixtures["gguf"]), progress=False).relative_to(ctx.live))


class Convert(Artefact):
    """`sequoia-offload convert GGUF OUT` (GGUF -> safetensors). Run again over a folder that a
    killed run finished, it refuses to overwrite it (exit 2): the folder must then be whole."""
    name, out_label = "convert", "converted folder"

    def op(self, ctx, first):
        return cli_main(["convert-gguf", ctx.fixtures["gguf"], str(ctx.live / "out" / "model")])

    def check(self, ctx, run, ref, post):
        kept = os.path.join("out", "model") in post and run.result == 2 and "already exists" in run.log
        if run.status == 0 and (run.result == 0 or kept):
            return []
        return [f"exit status {run.status}, result {run.result}: {run.log[-800:]}"]


class Store(Artefact):
    """A packed layer store (`layer_store.open_or_build`) of a tiny safetensors checkpoint."""

    def __init__(self, weights: str, dtype: torch.dtype):
        self.weights, self.dtype = weights, dtype
        self.name = f"store-{weights}" if weights != "auto" else "store-bf16"

    def op(self, ctx, first):
        folder = Path(ctx.fixtures["ckpt"])
        ckpt = open_checkpoint(folder, load_config(folder))
        store = open_or_build(ckpt, self.dtype, cache_root() / "stores", progress=False, weights=self.weights)
        return store.folder.name


class Profile(Artefact):
    """`sequoia-offload profile` (the cached machine profile `--tree auto` reads)."""
    name = "profile"

    def op(self, ctx, first):
        return cli_main(["profile", "--target", ctx.fixtures["ckpt"], "--draft", ctx.fixtures["draft"],
                         "--offload", "none", "--budget-s", str(PROFILE_BUDGET_S)])

    def normalise(self, rel, data):
        return _timings_blind(data) if rel.startswith(os.path.join("cache", "sequoia-offload", "profiles")) else data

    def validate(self, ctx, unit):
        if self.label(unit) != "profile":
            return []
        try:
            if "-target-" in Path(unit).name:  # the target's part, shared by the drafts profiled on its plan
                assert read_target_part(ctx.live / unit) is not None, "not a whole target part"
            else:
                load_measured(ctx.live / unit)
            return []
        except Exception as e:  # noqa: BLE001 - reported as the failure it is
            return [f"{unit}: does not load ({e})"]


class Distill(Artefact):
    """`distill` of a 1-layer student, resumed (--resume) when a killed run left its work folder."""
    name, out_label = "distill", "student"

    def op(self, ctx, first):
        out = ctx.live / "out" / "draft"
        resume = not first and work_dir(out).exists()
        try:
            distill(ctx.fixtures["ckpt"], out, DistillOptions(**DISTILL, prompts=ctx.fixtures["prompts"]),
                    resume=resume, progress=False)
        except UserError as e:
            return {"resumed": resume, "refused": str(e)}
        return {"resumed": resume}

    def check(self, ctx, run, ref, post):
        """Finished; or refused because a killed run had finished (its student in place, its work
        folder gone), as the same command is refused after any finished run."""
        if run.status != 0:
            return [f"exit status {run.status}: {run.log[-800:]}"]
        finished = os.path.join("out", "draft") in post and os.path.join("out", "draft.partial") not in post
        refused = run.result.get("refused")
        if refused and not (finished and "exists and is not empty" in refused):
            return [f"refused: {refused}"]
        return []

    def normalise(self, rel, data):
        """Wall times aside: the finished report's and the saved progress's (in the state file's header)."""
        if os.path.basename(rel) == "distill.json":  # the finished folder's, or its temporary's
            report = json.loads(data)
            report.pop("seconds", None)
            return json.dumps(report).encode()
        if os.path.basename(rel).startswith("state.safetensors"):
            try:
                n = int.from_bytes(data[:8], "little")
                header = json.loads(data[8:8 + n])
                progress = json.loads(header["__metadata__"]["progress"])
                progress.pop("seconds")
                header["__metadata__"]["progress"] = json.dumps(progress)
                return json.dumps(header).encode() + data[8 + n:]
            except (ValueError, KeyError, TypeError):
                return data  # a partial file: compared as it is
        return data


class Serve(Artefact):
    """`sequoia-offload serve` on a GGUF target with the default draft (its committed layers
    swapped for a tiny one made for this target), layers streamed from disk and --tree auto: on
    startup it writes the sidecar, the default draft's folder, the layer store, the machine
    profile and the pair's acceptance vectors. Done when it answers; a next run must answer the
    same greedy completion."""
    name, server = "serve", True

    def op(self, ctx, first):
        drafts.DEFAULT_DRAFT = Path(ctx.fixtures["committed_draft"])
        profiler.cached_or_measured.__defaults__ = (PROFILE_BUDGET_S, True, False)
        measure.AUTO_PROMPTS, measure.AUTO_NEW_TOKENS = SERVE_AUTO_PROMPTS, SERVE_AUTO_NEW_TOKENS
        measure.DEFAULT_PROMPTS = Path(ctx.fixtures["prompts"])
        return cli_main(["serve", "--target", ctx.fixtures["gguf"], *SERVE_FLAGS, "--port", str(ctx.port)])

    def query(self, ctx):
        url = f"http://127.0.0.1:{ctx.port}"
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": model, **PROMPT}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def check(self, ctx, run, ref, post):
        if not run.served:
            return [f"the server did not come up (status {run.status}): {run.log[-800:]}"]
        return [] if run.query == ref.query else [f"answered {run.query!r}, uninterrupted {ref.query!r}"]

    def normalise(self, rel, data):
        # (what a planner learned depends on the trees it ran, and those on the timings: compared
        # by its fields, as a profile is)
        measured = any(rel.startswith(os.path.join("cache", "sequoia-offload", kind)) for kind in ("profiles", "learned"))
        return _timings_blind(data) if measured else data

    def validate(self, ctx, unit):
        if self.label(unit) != "learned acceptance":
            return Profile.validate(self, ctx, unit)
        state = json.loads((ctx.live / unit).read_text())  # (a kill never leaves it half written)
        prior = AcceptanceVector(tuple(state["prior"]))
        why = learned.load(ctx.live / unit, prior)[1]
        return [] if why is None else [f"{unit}: not usable ({why})"]


ARTEFACTS = {a.name: a for a in (Sidecar(), Convert(), Store("auto", torch.bfloat16), Store("q4_0", torch.float32),
                                 Profile(), Distill(), Serve())}
