"""The layer-streaming executor: one pipelined loop over the decoder layers.

Resident layers are yielded as they are. Streamed layers pass through `k` device buffers: a
loader thread fills buffer (n mod k) with the n-th streamed layer (cycling over passes, so the
first streamed layers of the next pass load during the tail of this one) while the compute side
runs the layer in another buffer.

On CUDA the loader issues non-blocking copies from pinned memory on its own `copy_stream` and
records a per-buffer `ready` event; the compute stream waits on that event (a GPU-side wait) and
records a per-buffer `free` event after the layer, which the copy stream waits on before reusing
the buffer. Disk-tier layers are read with O_DIRECT into pinned staging buffers first, where the
reader checks their checksums on the CPU before any copy to the device is issued. Nothing
inside a pass synchronises the device. On the CPU the same loop runs with the loader thread doing
the memcpy (RAM tier) or the O_DIRECT read straight into the buffer (disk tier). A read that fails
(an I/O error, a short read, a checksum mismatch) stops the loader before the buffer is marked
ready, and the compute side raises its error instead of running the layer.

Two semaphores per buffer order the CPU sides: `free` (the compute side is done issuing work on
the buffer, so its free event is recorded) and `ready` (the loader has issued or done the fill).

Bytes are counted as they move, not taken from the plan: each fill records what the reader's
reads returned (disk) and what was copied into the buffer (a pinned or RAM block to the device
buffer), and the compute side adds a fill's counts to the stats when it takes that buffer. Fills
the loader made ahead for the next pass are reported apart (`prefetched_bytes`, a level, not a
sum), and fills thrown away when a pass is abandoned are never counted.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..formats import gguf_native
from ..formats.gguf_blocks import BLOCK_SIZES
from .blocks import to_dense
from .block_reader import BlockReader
from .layer_store import StoreLayout, aligned_buffer
from .model import LayerWeights
from .placement import PlacementPlan

_POLL_S = 0.2  # how often a blocked thread checks whether the executor was closed
SWITCH_INTERVAL_S = 0.0005
_CUDA_HOST_REGISTER_PORTABLE = 1
IDLE_TAIL_LAYERS = 2  # no idle work while waiting for the last layers: the pass would end late
# The CPU's fit rule for `idle` work (`LayerExecutor.fit_units`): a unit starts only when it is
# counted on to end before the layer waited for is in. The layer is counted on to be in this
# quantile of the recent fills' durations after its fill began (a low one: a fill that comes
# early is the one a unit overruns; RAM copies and disk reads apart), and a unit to take this
# quantile of the recent units' (those that did work: a call with nothing to do is not one).
# With a second buffer and the next layer streamed too, a unit may end later by the slack the
# next wait has to absorb it (`LayerExecutor.fit_slack`, off by default): the low fill quantile
# less this quantile of the recent streamed layers' compute; the loader fills the next layer
# meanwhile, so a layer started that late still ends before the next one is in. Off because on
# this project's 2-core CPU the pass grew more with it than without in every configuration
# measured: the lateness did not all come out of the next wait (docs/substitute-drafts.md).
FIT_WINDOW = 16  # recent fills, units and layers the quantiles are of
FIT_MIN = 4  # of each, before the rule holds a unit back (until then every unit runs: learning)
FIT_FILL_QUANTILE = 0.25
FIT_UNIT_QUANTILE = 0.75
FIT_COMPUTE_QUANTILE = 0.75
# Units are timed only when they run, so a rule holding every unit back would never learn that
# they got shorter (a slow spell passed, another variant's trees): after this many waits held
# in a row the units' durations are forgotten and learnt again (the next FIT_MIN units run), and
# the next such probe waits twice as many, up to FIT_PROBE_MAX (back to FIT_PROBE once a unit
# fits by the rule again). Where the units are still too long, a probe costs FIT_MIN overruns.
FIT_PROBE = 64
FIT_PROBE_MAX = 1024


@dataclass
class FitMemory:
    """What the CPU's fit rule goes by (FIT_*): the recent fills' durations, per tier (RAM
    copies and disk reads take different times), the recent idle units' and streamed layers'
    durations, and the probe's state. One per executor; a benchmark comparing modes on one
    executor gives each mode its own (`LayerExecutor.fit_memory`)."""
    fills: dict = field(default_factory=lambda: {tier: deque(maxlen=FIT_WINDOW) for tier in ("ram", "disk")})
    units: deque = field(default_factory=lambda: deque(maxlen=FIT_WINDOW))
    layers: deque = field(default_factory=lambda: deque(maxlen=FIT_WINDOW))
    held_in_a_row: int = 0
    probe_after: int = FIT_PROBE


@dataclass
class StreamStats:
    target_passes: int = 0
    bytes_streamed: int = 0  # measured: bytes copied into the device buffers that passes consumed
    bytes_read: int = 0  # measured: bytes read from disk (O_DIRECT) for the layers passes consumed
    copy_seconds: float = 0.0  # time spent moving layer bytes (disk reads + copies)
    compute_seconds: float = 0.0  # time the compute side spent in layers
    stall_seconds: float = 0.0  # time the compute side waited for a layer's bytes
    dequant_seconds: float = 0.0  # time turning streamed blocks into compute-dtype weights (copy side)
    pass_seconds: float = 0.0
    idle_work_seconds: float = 0.0  # of the stalls: other work done while waiting (`LayerExecutor.idle`)
    idle_window_seconds: float = 0.0  # of the stalls: those where `idle` work may run (not the last layers')
    # how much later layers started than they could have: the time from a layer being in to the
    # end of the `idle` work that was still running then (what growing ahead added to the pass)
    idle_overrun_seconds: float = 0.0
    idle_held: int = 0  # waits whose next unit of `idle` work was held back: it would not have fitted

    prefetched_bytes: int = 0  # filled ahead for the next pass, not yet consumed (when read)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["effective_gbps"] = self.bytes_streamed / self.pass_seconds / 1e9 if self.pass_seconds else 0.0
        return d

    def minus(self, other: "StreamStats") -> "StreamStats":
        """Counts between two snapshots (prefetched_bytes is a level: the later one's)."""
        d = {k: getattr(self, k) - getattr(other, k) for k in self.__dict__}
        d["prefetched_bytes"] = self.prefetched_bytes
        return StreamStats(**d)


class _Clock:
    """Timestamps on the compute/copy timeline: CUDA events on a GPU, perf_counter on the CPU.

    Events are resolved into seconds only when stats are read, after the pass, so timing never
    synchronises inside a pass.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class LayerExecutor:
    """Yields each decoder layer's weights on the device, in order, once per `passes()` iteration."""

    def __init__(self, plan: PlacementPlan, layout: StoreLayout, device: torch.device,
                 resident: dict[int, LayerWeights], ram_blocks: dict[int, torch.Tensor],
                 reader: BlockReader | None):
        self.plan, self.layout, self.device = plan, layout, device
        self.resident, self.ram_blocks, self.reader = resident, ram_blocks, reader
        self.order = plan.streamed_layers
        self.cuda = device.type == "cuda"
        if self.cuda:  # the loader thread must select the same device, and needs its index
            self.device = device = torch.device("cuda", device.index if device.index is not None
                                                else torch.cuda.current_device())
        self._in_pass = False
        # work to do while a pass waits for a streamed layer (a draft growing the next tree:
        # `SpeculativeDecoder`): called, one unit at a time, while the layer is not in yet;
        # returns False when it has nothing left
        self.idle: Callable[[], bool] | None = None
        self._idle_done = None  # CUDA: the event after the last idle unit queued
        # the CPU's fit rule (FIT_*): what it goes by in `fit_memory`, and per buffer when its
        # fill began (`_fill_began`, set by `_start_loader`); False runs units until the layer
        # is in, as on CUDA (where the GPU runs each unit in a copy's gap)
        self.fit_units = True
        self.fit_slack = False  # (True: a unit may end in the next wait's slack, FIT_*)
        self.fit_memory = FitMemory()
        # this pass's idle work: None (not asked yet), "ran" (a unit returned True), "spent"
        # (it returned False: not asked again until the next pass)
        self._idle_state: str | None = None
        self.clock = _Clock(self.cuda)
        self.stats = StreamStats()
        self._pending: list[tuple[str, object, object]] = []  # (stat name, start, end) to resolve
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        k = plan.buffers if self.order else 0
        # per buffer: when its last fill was in (perf_counter on the CPU, an event on the copy
        # stream on CUDA), for `idle_overrun_seconds`
        self.ready_at: list[object] = [None] * k
        self.buffers = [self._device_block() for _ in range(k)]
        # compute-dtype weights of the slots a streamed layer holds in another format, one set
        # per buffer: the copy side converts each filled block into its buffer's set
        self.scratch = [{n: torch.empty(shape, dtype=layout.layouts[0].dtype, device=self.device)
                         for n, shape in layout.packed_shapes(self.order).items()} for _ in range(k)]
        # per (buffer, layout): the weights a layer runs with, and its packed slots over the
        # buffer's bytes; made here, once, so neither thread ever builds them
        self._views: dict[tuple[int, int], tuple[LayerWeights, dict]] = {}
        for b in range(k):
            for i in self.order:
                lay = layout.layouts[i]
                if (b, id(lay)) not in self._views:
                    raw = lay.views(self.buffers[b][:lay.block_bytes])
                    packed = {n: raw[n] for n in lay.packed}
                    self._views[(b, id(lay))] = ({n: self.scratch[b][n] if n in packed else w for n, w in raw.items()},
                                                 packed)
        self._warm_up()
        if self.cuda and self.order:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready_events = [torch.cuda.Event() for _ in range(k)]
            self.free_events = [torch.cuda.Event() for _ in range(k)]
            self.staging = [pinned_block(layout.max_block, device) for _ in range(2)] if plan.disk_layers else []
            self.staged_events = [torch.cuda.Event() for _ in self.staging]
        self._thread: threading.Thread | None = None
        if self.order:
            # The loader needs the GIL back soon after each read returns; with Python's default
            # 5 ms switch interval the disk sat idle while the compute thread ran Python code
            # (measured on 2 cores: 0.5 ms made disk-streamed passes of 64-128 tokens faster).
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._start_loader()

    def _start_loader(self) -> None:
        """A fresh loader at the start of a pass, buffer 0 first. A read error that stopped the
        last pass is forgotten: the next pass reads again (a damaged block, never marked
        verified, fails again; a disk's passing hiccup does not stop a server for good)."""
        k = len(self.buffers)
        self._error = None
        self._stop = threading.Event()
        self._consumed = 0
        # per buffer: (fill number, when it began); an abandoned pass's numbers are not this one's
        self._fill_began: list[tuple[int, float] | None] = [None] * k
        self.free = [threading.Semaphore(1) for _ in range(k)]
        self.ready = [threading.Semaphore(0) for _ in range(k)]
        self.filled = [(0, 0)] * k  # per buffer: (bytes read from disk, bytes copied in) by its last fill
        self._filled_ahead = 0  # bytes of fills done and not yet consumed
        if self.order:
            self._thread = threading.Thread(target=self._loader, args=(self._stop,), name="layer-loader",
                                            daemon=True)
            self._thread.start()

    def _stop_loader(self) -> bool:
        """Stop the loader (it finishes the read in hand); True when it has really ended. A loader
        waiting for a free buffer is woken at once (its buffers' semaphores are this loader's
        alone: `_start_loader` makes new ones), not at its next poll: every close of a streamed
        engine, and every abandoned pass, waited 0.07-0.13 s for it."""
        self._stop.set()
        for sem in self.free:
            sem.release()
        joined = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            joined = not self._thread.is_alive()
            self._thread = None
        if self.cuda and self.order:
            self.copy_stream.synchronize()  # copies in flight may still read staging / RAM blocks
        return joined

    def _device_block(self) -> torch.Tensor:
        if self.cuda:
            return torch.empty(self.layout.max_block, dtype=torch.uint8, device=self.device)
        return aligned_buffer(self.layout.max_block)  # page-aligned: O_DIRECT reads land here

    def views(self, b: int, layer: int) -> tuple[LayerWeights, dict]:
        """(the weights a layer in buffer b runs with, its packed slots over the buffer's bytes)."""
        return self._views[(b, id(self.layout.layouts[layer]))]

    def _warm_up(self) -> None:
        """Build what the first conversion of each stored format would otherwise build inside
        the first pass: the compiled CPU loop, or the GPU kernel of each format."""
        formats = {s.fmt for s in self.layout.packed_slots(self.order)}
        for fmt in sorted(formats):
            block, size = BLOCK_SIZES[fmt]
            to_dense(torch.zeros(size, dtype=torch.uint8, device=self.device), fmt, (1, block),
                     self.layout.layouts[0].dtype)
        if formats and self.cuda:
            torch.cuda.synchronize(self.device)

    def _dequantize(self, layer: int, b: int) -> None:
        """Turn the packed slots of the block in buffer b into its compute-dtype scratch (on CUDA,
        queued on the copy stream, so it overlaps the compute of earlier layers). On the CPU the
        compiled loop takes the layer's tensors in one call, which splits them between threads
        (`gguf_native.dequantize_many`); the same values as one `to_dense` each."""
        packed = self.views(b, layer)[1]
        if not self.cuda and gguf_native.dequantize_many(
                [(p.data.reshape(-1), p.fmt, self.scratch[b][name], *BLOCK_SIZES[p.fmt]) for name, p in packed.items()]):
            return
        for name, p in packed.items():
            to_dense(p.data, p.fmt, p.shape, p.dtype, out=self.scratch[b][name])

    # ---- the compute side -------------------------------------------------------------------

    def __iter__(self) -> Iterator[LayerWeights]:
        """One pass over all layers. Abandoning it midway restarts the loader at the next pass."""
        if self._in_pass:
            raise RuntimeError("a pass is already running on this executor (passes cannot overlap)")
        self._in_pass = True
        self._collect(wait=False)
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        pass_start = self.clock.mark(stream)
        last_end, done, held = pass_start, 0, None
        self._idle_state = None
        try:
            for i in range(self.plan.num_layers):
                if i in self.resident:
                    w = self.resident[i]
                else:
                    b = self._consumed % len(self.buffers)
                    self._wait_ready(b, i, last_end)
                    held = b
                    with self._lock:  # the bytes this buffer's fill moved, counted as consumed
                        read, copied = self.filled[b]
                        self.stats.bytes_read += read
                        self.stats.bytes_streamed += copied
                        self._filled_ahead -= copied
                    if self.cuda:
                        stream.wait_event(self.ready_events[held])
                    w = self.views(held, i)[0]
                start = self.clock.mark(stream)
                self._pending.append(("stall_seconds", last_end, start))
                if held is not None and i < self.plan.num_layers - IDLE_TAIL_LAYERS:
                    self._pending.append(("idle_window_seconds", last_end, start))
                yield w
                last_end = self.clock.mark(stream)
                self._pending.append(("compute_seconds", start, last_end))
                if held is not None and not self.cuda:
                    with self._lock:
                        self.fit_memory.layers.append(last_end - start)
                if held is not None:
                    self._release(held, stream)
                    held = None
                done = i + 1
        finally:
            try:
                if done < self.plan.num_layers and self.order:
                    # abandoned midway (an error, Ctrl-C): rather than wait for the rest of the
                    # pass to stream in, restart the loader at the top of the next pass
                    if held is not None and self.cuda:  # kernels already queued may still read it
                        self.free_events[held].record(stream)
                    if not self._stop_loader():
                        raise RuntimeError("layer loader did not stop within 30 s")
                    self._start_loader()
            finally:
                self._in_pass = False
        self._pending.append(("pass_seconds", pass_start, last_end))
        with self._lock:
            self.stats.target_passes += 1

    def _release(self, b: int, stream) -> None:
        """The compute side is done issuing work on buffer b: hand it back to the loader."""
        if self.cuda:
            self.free_events[b].record(stream)
        self._consumed += 1
        self.free[b].release()

    def _wait_ready(self, b: int, i: int, since) -> None:
        """Wait for buffer b's layer (layer i), doing `idle` work while it is not in: on the CPU
        while the loader has not filled it, on CUDA while its copy has not landed (the work is
        queued on the compute stream ahead of the layer, so it runs in the gap). What that work
        delayed the layer by is added to `idle_overrun_seconds`: on the CPU, from the layer being
        in to the end of the last unit; on CUDA, from the later of the layer's copy and the end
        of the layer before (`since`) to the end of the work queued before the layer."""
        idle = self.idle if i < self.plan.num_layers - IDLE_TAIL_LAYERS and self._idle_state != "spent" else None
        if idle is None:
            return self._acquire(self.ready[b])
        unit_end, more = None, True  # when the last unit of idle work returned (None: none ran)
        while not self.ready[b].acquire(blocking=False):
            if self._error is not None:
                self._raise_loader_error()
            if not self.cuda and not self._unit_fits(b, i):
                if not self.ready[b].acquire(blocking=False):  # (not in meanwhile: a unit held back)
                    with self._lock:
                        self.stats.idle_held += 1
                    self._acquire(self.ready[b])
                break
            more = self._idle_unit(idle)
            unit_end = time.perf_counter()
            if not more:
                self._acquire(self.ready[b])
                break
        if self._error is not None:
            self._raise_loader_error()
        if self.cuda:  # one unit queued at a time: the next only once the GPU has run the last
            stream = torch.cuda.current_stream(self.device)
            while more and not self.ready_events[b].query():
                if self._idle_done is not None and not self._idle_done.query():
                    break
                more = self._idle_unit(idle)
                unit_end = time.perf_counter()
                self._idle_done = torch.cuda.Event()
                self._idle_done.record(stream)
                if not more:
                    break
            if unit_end is not None:  # (the layer's kernels start after the work queued before them)
                self._pending.append(("idle_overrun_seconds", (self.ready_at[b], since), self.clock.mark(stream)))
        elif unit_end is not None:
            self._pending.append(("idle_overrun_seconds", (self.ready_at[b],), unit_end))

    def overrun_seconds(self) -> float:
        """`idle_overrun_seconds` so far (on CUDA, of the passes whose events have completed)."""
        self._collect(wait=False)
        return self.stats.idle_overrun_seconds

    def _idle_unit(self, idle: Callable[[], bool]) -> bool:
        """One unit of idle work, timed. A unit counts toward the fit rule's durations when it
        returned True, or False after units that returned True this pass (the one that finished
        the work); a False at once is a call with nothing to do, and its microseconds would
        make every unit look short. After a False, idle is not asked again this pass."""
        start = time.perf_counter()
        more = idle()
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.idle_work_seconds += seconds
            if more or self._idle_state == "ran":
                self.fit_memory.units.append(seconds)
        self._idle_state = "ran" if more else "spent"
        return more

    def _unit_fits(self, b: int, i: int) -> bool:
        """The CPU's fit rule: whether the next unit of idle work is counted on to end before
        buffer b's layer (layer i, the fill numbered `_consumed`) is in, or with `fit_slack`
        within the slack the next streamed layer's wait leaves (FIT_*). True while a side has
        fewer than FIT_MIN durations to go by, always with `fit_units` off, and for a probe
        after FIT_PROBE (doubling) waits held in a row (which forgets the units' durations)."""
        if not self.fit_units:
            return True
        mem = self.fit_memory
        with self._lock:
            fills, units, began = sorted(mem.fills[self._tier(i)]), sorted(mem.units), self._fill_began[b]
            layers = sorted(mem.layers)
        if len(fills) < FIT_MIN or len(units) < FIT_MIN:
            return True
        fill = _quantile(fills, FIT_FILL_QUANTILE)
        if began is not None and began[0] == self._consumed:
            left = began[1] + fill - time.perf_counter()
        else:  # (not begun: the loader is still on the fill before it)
            left = fill
        if (self.fit_slack and len(self.buffers) > 1 and i + 1 not in self.resident
                and len(layers) >= FIT_MIN):
            left += max(0.0, fill - _quantile(layers, FIT_COMPUTE_QUANTILE))
        if _quantile(units, FIT_UNIT_QUANTILE) <= left:
            mem.held_in_a_row, mem.probe_after = 0, FIT_PROBE
            return True
        mem.held_in_a_row += 1
        if mem.held_in_a_row < mem.probe_after:
            return False
        mem.held_in_a_row, mem.probe_after = 0, min(2 * mem.probe_after, FIT_PROBE_MAX)
        mem.units.clear()  # (a probe: this unit and the next FIT_MIN - 1 run and are timed)
        return True

    def _tier(self, layer: int) -> str:
        """Which of `FitMemory.fills` a streamed layer's fills are counted in."""
        return "ram" if layer in self.ram_blocks else "disk"

    def _acquire(self, sem: threading.Semaphore) -> None:
        while not sem.acquire(timeout=_POLL_S):
            if self._error is not None:
                self._raise_loader_error()
            if self._stop.is_set():
                raise RuntimeError("layer executor is closed")
        if self._error is not None:
            self._raise_loader_error()

    def _raise_loader_error(self) -> None:
        """Stop the pass with what stopped the loader: a store that cannot be read whole or
        fails its checksum (a UserError, kept so the message reaches the user as one line),
        or a bug. A block that failed is never handed to a layer."""
        e = self._error
        if isinstance(e, UserError):
            raise type(e)(str(e)) from e
        raise RuntimeError(f"layer loader failed: {e}") from e

    def snapshot(self) -> StreamStats:
        """Stats so far (waits for pending CUDA timings: call between passes, never inside one)."""
        self._collect(wait=True)
        with self._lock:
            return StreamStats(**{**self.stats.__dict__, "prefetched_bytes": self._filled_ahead})

    def _collect(self, wait: bool) -> None:
        """Fold timings into the stats: all of them (wait=True), or only those already complete,
        without blocking (called at each pass start, so pending events never pile up)."""
        with self._lock:
            keep = []
            for name, start, end in self._pending:
                # (an overrun has several starts, its layer's copy on another stream than its end;
                # it runs from the latest of them)
                starts = start if isinstance(start, tuple) else (start,)
                if wait or not self.cuda or (end.query() and all(s.query() for s in starts)):
                    if wait and self.cuda:  # (else every start has been asked: complete)
                        for s in starts:
                            s.synchronize()
                    seconds = min(self.clock.seconds(s, end) for s in starts)
                    if name == "idle_overrun_seconds":  # (the layer in after the work ended: none)
                        seconds = max(0.0, seconds)
                    setattr(self.stats, name, getattr(self.stats, name) + seconds)
                else:
                    keep.append((name, start, end))
            self._pending = keep

    # ---- the loader thread ------------------------------------------------------------------

    def _loader(self, stop: threading.Event) -> None:
        n = 0
        try:
            if self.cuda:
                torch.cuda.set_device(self.device.index)  # a new thread starts on device 0
            while not stop.is_set():
                layer = self.order[n % len(self.order)]
                b = n % len(self.buffers)
                source, read = self._stage(layer, n)
                while not self.free[b].acquire(timeout=_POLL_S):
                    if stop.is_set():
                        return
                if stop.is_set():  # (woken by `_stop_loader`)
                    return
                began = time.perf_counter()
                with self._lock:  # (the fit rule's: when this fill began)
                    self._fill_began[b] = (n, began)
                read, copied = self._fill(layer, b, source, n, read)
                with self._lock:
                    self.filled[b] = (read, copied)
                    self._filled_ahead += copied
                    if not self.cuda:  # (CUDA: the event after the copy and conversion, `_fill`)
                        self.ready_at[b] = time.perf_counter()
                        self.fit_memory.fills[self._tier(layer)].append(self.ready_at[b] - began)
                self.ready[b].release()
                n += 1
        except BaseException as e:  # surfaced on the compute side by _acquire
            self._error = e
            for sem in self.ready:
                sem.release()

    def _stage(self, layer: int, n: int) -> tuple[torch.Tensor | None, int]:
        """CUDA + disk tier: read the block into a pinned staging buffer before a device buffer
        frees; returns it and the bytes read."""
        if not (self.cuda and layer in self.plan.disk_layers):
            return None, 0
        s = n % len(self.staging)
        self.staged_events[s].synchronize()  # the copy that last read this staging buffer is done
        t0 = time.perf_counter()
        read = self.reader.read(layer, self.staging[s])
        with self._lock:
            self.stats.copy_seconds += time.perf_counter() - t0
        return self.staging[s], read

    def _fill(self, layer: int, b: int, staged: torch.Tensor | None, n: int, read: int) -> tuple[int, int]:
        """Fill device buffer b with `layer` (and convert its packed slots); returns (bytes read
        from disk, bytes copied in)."""
        size = self.layout.sizes[layer]
        dest = self.buffers[b][:size]
        packed = bool(self.layout.layouts[layer].packed)
        if self.cuda:
            src = staged[:size] if staged is not None else self.ram_blocks[layer]
            self.copy_stream.wait_event(self.free_events[b])  # compute is done with this buffer
            start = self.clock.mark(self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                dest.copy_(src, non_blocking=True)
                end = self.clock.mark(self.copy_stream)
                if staged is not None:  # the staging buffer is free once copied, not converted
                    self.staged_events[n % len(self.staging)].record(self.copy_stream)
                if packed:
                    self._dequantize(layer, b)
            self.ready_events[b].record(self.copy_stream)
            converted = self.clock.mark(self.copy_stream)
            self.ready_at[b] = converted
            with self._lock:
                self._pending.append(("copy_seconds", start, end))
                if packed:
                    self._pending.append(("dequant_seconds", end, converted))
            return read, size
        t0 = time.perf_counter()
        if layer in self.ram_blocks:
            # a plain memcpy, not torch's copy_: a parallel torch op on this thread would leave
            # OpenMP a second thread team, which slows the compute thread's every matmul while
            # the loader lives (see `dequantize_many` in formats/gguf_native.c)
            src = self.ram_blocks[layer]
            if not (src.is_contiguous() and dest.is_contiguous() and size <= min(src.numel(), dest.numel())):
                raise RuntimeError(f"layer {layer}: a RAM block of {src.numel()} bytes cannot fill {size}")
            ctypes.memmove(dest.data_ptr(), src.data_ptr(), size)
            copied = size
        else:  # the O_DIRECT read lands in the buffer itself: what was read is what came in
            read = copied = self.reader.read(layer, self.buffers[b])
        t1 = time.perf_counter()
        if packed:
            self._dequantize(layer, b)
        with self._lock:
            self.stats.copy_seconds += t1 - t0
            self.stats.dequant_seconds += time.perf_counter() - t1
        return read, copied

    def close(self) -> None:
        """Stop the loader, let in-flight copies land, release the reader and unpin host memory."""
        joined = self._stop_loader()
        if self.cuda and self.order:
            for block in list(self.ram_blocks.values()) + self.staging:
                unpin_block(block)
            self.ram_blocks, self.staging = {}, []
        if self.reader is not None and joined:  # never close the fd under an in-flight read
            self.reader.close()


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of an ordered list (the nearest rank below)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pinned_block(nbytes: int, device: torch.device) -> torch.Tensor:
    """Exact-size, page-aligned, pinned host memory: an anonymous mmap registered with CUDA as
    portable (every context sees it pinned). O_DIRECT needs the alignment, async copies the
    pinning; torch's own pinned allocator would round the size up to a power of two."""
    block = aligned_buffer(nbytes)
    with torch.cuda.device(device):
        rc = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(rc)}")
    return block


def unpin_block(block: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
