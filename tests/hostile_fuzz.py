"""Child runner of the fuzzed-parser suite (issue 22, item 1): each parser fuzzed with hypothesis in
a process of its own (several parsers: forked from one process that imported everything once), so
that its peak RSS is the imports' and that parser's alone; writes a JSON report per parser.

    python tests/hostile_fuzz.py PARSER --examples N --report out.json [--save DIR --keep K]
    python tests/hostile_fuzz.py config=80 gguf=60 ... --report DIR [--parallel 2]   (forked children)

Every input (tests/hostile_inputs.py, tests/hostile_binary.py) must load or raise a one-line UserError, within
PER_EXAMPLE_S seconds and under an address-space limit (RLIMIT_AS: a blow-up fails here instead
of thrashing the machine), leave its input files as they were, and leave no temporary file
behind; HOME and XDG_CACHE_HOME point into a temporary folder, the only place a parser may write.
Anything else is recorded as unexpected, with its traceback's last lines; tests/test_hostile_parsers.py
asserts that there is none. With --save, the first K refused inputs (distinct messages) are
copied to DIR with the CLI command that reads them, for the test to run the real CLI on.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

PER_EXAMPLE_S = 10.0  # a parser that takes longer on a file of a few KiB hangs (the slowest seen: < 1 s)
GUARD_BYTES = 2 * 2**30  # address space allowed beyond what the imports mapped: far above any input here


class ExampleTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no parser's `except Exception` swallows it."""


@dataclass
class Parser:
    build: Callable  # (folder, draw=None) -> the path the loader gets
    load: Callable  # (path) -> None; raises UserError to refuse
    cli: list[str]  # the CLI command that reads such a file ({input} replaced by its path)
    sweep: Callable | None = None  # () -> extra (name, build) inputs run besides the random ones
    complete: Callable | None = None  # (folder) -> writes what else the CLI needs to get that far
    env: dict = field(default_factory=dict)  # the CLI's environment ({root}: the input's folder)


# ---- loaders: what the runtime does with each file ----------------------------------------------

def load_config_folder(folder: Path) -> None:
    from offload_engine.formats.config import load_config
    load_config(folder)


def load_safetensors(folder: Path) -> None:
    import torch

    from offload_engine.formats.checkpoint import Checkpoint, fingerprint
    from offload_engine.formats.config import load_config
    ckpt = Checkpoint(folder, load_config(folder))
    try:
        ckpt.check()
        ckpt.source_formats()
        for name in ckpt.shapes:
            ckpt.load(name, torch.float32)
    finally:
        ckpt.close()
    fp = fingerprint(folder)
    assert fp is None or (isinstance(fp, str) and len(fp) == 16), f"fingerprint gave {fp!r}"


def load_gguf(path: Path) -> None:
    """As a model named by a GGUF path loads: its sidecar folder, whose config, tokenizer and every
    tensor must then load too; and converted to a safetensors folder (convert-gguf)."""
    import torch

    from offload_engine.formats import gguf_import
    from offload_engine.formats.config import load_config
    from offload_engine.formats.gguf_model import GGUFCheckpoint, sidecar_for
    from offload_engine.formats.tokenizer import Tokenizer
    folder = sidecar_for(path, progress=False)
    ckpt = GGUFCheckpoint(folder, load_config(folder))
    try:
        ckpt.check()
        for name in ckpt.entries:
            ckpt.load(name, torch.float32)
    finally:
        ckpt.close()
    Tokenizer.from_folder(folder).encode("ab c\n")
    out = path.parent.parent / "converted"
    try:
        gguf_import.convert_gguf(path, out, progress=False)
        load_safetensors(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def load_tokenizer(folder: Path) -> None:
    from offload_engine.formats.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode("Hello, world! The capital of France.\n 123")
    tok.decode(ids)


def load_prompts(path: Path) -> None:
    """Any file loads or is refused; a valid one (expected.json beside it) must read back whole."""
    from offload_engine.errors import UserError
    from offload_engine.speculation.measure import read_prompts
    expected = path.parent / "expected.json"
    try:
        items = read_prompts(path)
    except UserError as e:
        if expected.exists():
            raise AssertionError(f"a valid file was refused: {e}") from None
        raise
    if expected.exists():
        want = json.loads(expected.read_text())
        assert items == want, f"read back {items!r}, wrote {want!r}"


def load_profile(path: Path) -> None:
    from offload_engine.planning.hw_profile import load_gpu_spec, load_measured
    (load_measured if path.name == "measured.json" else load_gpu_spec)(path)


def load_acceptance(path: Path) -> None:
    from offload_engine.speculation.acceptance_store import read_vector, stored_vectors
    found = stored_vectors("0123456789abcdef", "self-int8", path.parent)  # a bad file is skipped, never raised
    assert isinstance(found, dict)
    read_vector(path)


def load_ollama(manifest: Path) -> None:
    from offload_engine.formats.model_names import ollama_blob
    root = manifest.parents[4]
    ollama_blob(manifest, "ollama:tiny", root)


GENERATE = ["generate", "--target", "{input}", "--draft", "none", "--prompt", "hi", "--max-new-tokens", "1", "--tree", "none",
            "--offload", "none"]


def _parsers() -> dict[str, Parser]:
    import hostile_binary as hb
    import hostile_inputs as hi
    return {
        "config": Parser(hi.build_config, load_config_folder, ["plan", "--target", "{input}"], hi.config_sweep),
        "safetensors": Parser(hb.build_safetensors, load_safetensors, GENERATE, hb.safetensors_sweep,
                              complete=hi.build_tokenizer),
        "gguf": Parser(hb.build_gguf, load_gguf, ["plan", "--target", "{input}"], hb.gguf_sweep),
        "tokenizer": Parser(hi.build_tokenizer, load_tokenizer, GENERATE, hi.tokenizer_sweep,
                            complete=hb.build_safetensors),
        "prompts": Parser(hi.build_prompts, load_prompts,
                          ["acceptance", "--target", "nowhere", "--draft", "self-int8", "--prompts", "{input}",
                           "--out", "{tmp}/out.json"], hi.prompts_sweep),
        "profile": Parser(hi.build_profile, load_profile, ["simulate", "--profile", "{input}"], hi.profile_sweep),
        "acceptance": Parser(hi.build_acceptance, load_acceptance,
                             ["simulate", "--gpu", "rtx4090", "--acceptance", "{input}"], hi.acceptance_sweep),
        "ollama": Parser(hi.build_ollama, load_ollama, ["plan", "--target", "ollama:tiny"], hi.ollama_sweep,
                         env={"OLLAMA_MODELS": "{root}"}),
    }


# ---- the harness ------------------------------------------------------------------------------

def _files(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _on_alarm(signum, frame):
    raise ExampleTimeout(f"no answer within {PER_EXAMPLE_S} s")


@dataclass
class Harness:
    name: str
    parser: Parser
    work: Path  # HOME, the cache and the inputs live here
    save: Path | None = None
    keep: int = 0
    tried: int = 0
    loaded: int = 0
    refused: int = 0
    max_s: float = 0.0
    slowest: str = ""
    unexpected: list = field(default_factory=list)
    messages: dict = field(default_factory=dict)  # a refusal's gist -> one full message
    saved: list = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)

    def example(self, label: str, build: Callable, draw=None) -> str:
        """Build one input, load it, check what loading left behind; returns the outcome."""
        folder = self.work / "inputs" / str(next(self.counter))
        folder.mkdir(parents=True)
        try:
            target = build(folder, draw) if draw is not None else build(folder)
        except BaseException:  # hypothesis stops a draw that runs out of data: no input then
            shutil.rmtree(folder)
            raise
        before = _files(folder)
        start = time.perf_counter()
        outcome, message = self._load(label, target)
        elapsed = time.perf_counter() - start
        self.tried += 1
        if elapsed > self.max_s and label != "base":  # the base example also imports the parser's modules
            self.max_s, self.slowest = elapsed, label
        if _files(folder) != before:
            self._unexpected(label, "the input files changed while loading", folder)
        self._check_leftovers(label, folder)
        if outcome == "refused":
            self.refused += 1
            self._keep(folder, target, message)
        elif outcome == "loaded":
            self.loaded += 1
        shutil.rmtree(folder)
        shutil.rmtree(self.work / "cache", ignore_errors=True)
        return outcome

    def _load(self, label: str, target: Path) -> tuple[str, str]:
        from offload_engine.errors import UserError
        signal.setitimer(signal.ITIMER_REAL, PER_EXAMPLE_S)
        try:
            self.parser.load(target)
            return "loaded", ""
        except UserError as e:
            message = str(e)
            if not message or "\n" in message or "\r" in message:
                self._unexpected(label, f"a UserError that is not one line: {message!r}", target)
            return "refused", message
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 (the point: every other exception is a bug)
            tail = "".join(traceback.format_exception(e)[-4:])
            self._unexpected(label, f"{type(e).__name__}: {str(e)[:300]}\n{tail[-1500:]}", target)
            return "unexpected", ""
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _check_leftovers(self, label: str, folder: Path) -> None:
        """Only the cache may gain files, and no temporary name may stay anywhere."""
        temps = [str(p) for p in self.work.rglob("*") if ".tmp" in p.name]
        outside = [str(p) for p in self.work.rglob("*") if p.is_file() and not p.is_relative_to(self.work / "cache")
                   and not p.is_relative_to(folder)]
        if temps or outside:
            self._unexpected(label, f"left behind: {(temps + outside)[:5]}", folder)
            for p in temps + outside:
                shutil.rmtree(p, ignore_errors=True) if Path(p).is_dir() else Path(p).unlink(missing_ok=True)

    def _unexpected(self, label: str, what: str, target: Path) -> None:
        files = {p.name: p.read_bytes()[:400].decode("latin-1") for p in sorted(Path(target).parent.rglob("*"))
                 if p.is_file()} if len(self.unexpected) < 20 else {}
        self.unexpected.append({"example": label, "error": what, "input": files})

    def _keep(self, folder: Path, target: Path, message: str) -> None:
        gist = message.split(": ", 1)[-1][:40]
        self.messages.setdefault(gist, message[:300])
        if self.save is None or len(self.saved) >= self.keep or any(s["gist"] == gist for s in self.saved):
            return
        dest = self.save / f"{self.name}-{len(self.saved)}"
        shutil.copytree(folder, dest)
        if self.parser.complete:
            self.parser.complete(dest)
        values = {"input": str(dest / target.relative_to(folder)), "tmp": str(dest), "root": str(dest)}
        self.saved.append({"gist": gist, "message": message,
                           "argv": [a.format(**values) for a in self.parser.cli],
                           "env": {k: v.format(**values) for k, v in self.parser.env.items()}})


def _guard_memory() -> int:
    """Cap the address space at what is mapped now plus GUARD_BYTES; returns the cap."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + GUARD_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def run(name: str, examples: int, work: Path, save: Path | None, keep: int) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    parser = _parsers()[name]
    h = Harness(name, parser, work, save, keep)
    start = time.perf_counter()
    base_ok = h.example("base", parser.build) == "loaded"  # also imports what the parser needs
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cap = _guard_memory()
    sweep = parser.sweep() if parser.sweep else []
    for label, build in sweep:
        h.example(label, build)

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        h.example(f"random-{h.tried}", parser.build, data.draw)

    fuzz()
    return {"parser": name, "base_loaded": base_ok, "examples": h.tried, "random": h.tried - 1 - len(sweep),
            "sweep": len(sweep), "loaded": h.loaded, "refused": h.refused, "unexpected": h.unexpected,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "baseline_rss_mib": round(baseline, 1), "address_space_cap_mib": cap // 2**20,
            "max_example_s": round(h.max_s, 3), "slowest": h.slowest, "wall_s": round(time.perf_counter() - start, 2),
            "refusals": dict(itertools.islice(h.messages.items(), 12)), "saved": h.saved}


def _fuzz_one(name: str, examples: int, report: Path, save: Path | None, keep: int) -> None:
    with tempfile.TemporaryDirectory(prefix=f"hostile-{name}-") as tmp:
        from hypothesis.configuration import set_hypothesis_home_dir
        set_hypothesis_home_dir(Path(tmp) / "hypothesis")  # its caches, outside the folder checked
        work = Path(tmp) / "work"
        work.mkdir()
        os.environ.update(HOME=str(work / "home"), XDG_CACHE_HOME=str(work / "cache"), SEQUOIA_OFFLOAD_NATIVE="0",
                          HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        os.chdir(work)
        signal.signal(signal.SIGALRM, _on_alarm)
        result = run(name, examples, work, save, keep)
    report.write_text(json.dumps(result, indent=2))


def _preload() -> None:
    """What every parser imports, imported once before the forks (about 4 s of CPU each time
    otherwise). No torch operation runs before a fork, so no thread pool is copied half-made."""
    import gguf  # noqa: F401
    import hypothesis  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401

    import hostile_binary  # noqa: F401
    import hostile_inputs  # noqa: F401
    import offload_engine.formats.checkpoint  # noqa: F401
    import offload_engine.formats.gguf_import  # noqa: F401
    import offload_engine.formats.gguf_model  # noqa: F401
    import offload_engine.formats.tokenizer  # noqa: F401


def _forked(jobs: list[tuple], parallel: int) -> int:
    """Each (name, examples, report, save, keep) fuzzed in a forked child, `parallel` at a time;
    a child's peak RSS is the imports' plus its parser's. Returns the number of failed children."""
    _preload()
    waiting, running, failed = list(jobs), {}, 0
    while waiting or running:
        while waiting and len(running) < parallel:
            job = waiting.pop(0)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _fuzz_one(*job)
                    code = 0
                except BaseException:  # noqa: BLE001 (reported; the parent counts the failure)
                    traceback.print_exc()
                finally:
                    os._exit(code)
            running[pid] = job[0]
        pid, status = os.wait()
        name = running.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
            print(f"hostile_fuzz: the {name} child failed (status {os.waitstatus_to_exitcode(status)})", file=sys.stderr)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parsers", nargs="+", help="parser names, or NAME=EXAMPLES to give each its own count")
    ap.add_argument("--examples", type=int, default=50, help="random examples per parser without its own count")
    ap.add_argument("--report", type=Path, required=True,
                    help="the report file (one parser) or folder (several: NAME.json in it)")
    ap.add_argument("--save", type=Path, default=None)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=2, help="children at a time (several parsers)")
    args = ap.parse_args()
    counts = {p.split("=")[0]: int(p.split("=")[1]) if "=" in p else args.examples for p in args.parsers}
    if len(counts) == 1:
        name, n = next(iter(counts.items()))
        _fuzz_one(name, n, args.report, args.save, args.keep)
        return 0
    args.report.mkdir(parents=True, exist_ok=True)
    return 1 if _forked([(n, k, args.report / f"{n}.json", args.save, args.keep) for n, k in counts.items()],
                        args.parallel) else 0


if __name__ == "__main__":
    sys.exit(main())
