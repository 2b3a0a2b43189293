"""How the ``torch.compile`` backend hands a call's tensors to a plan and the results back.

A plan replays as CUDA graphs on fixed addresses. ``Handoff`` keeps, beside the executor's own
graph (inputs copied into its buffers, outputs copied out of them), graphs bound to other
memory (``PlanExecutor.bind``):

- **inputs by pointer**: a graph that reads the tensors the backend compiled on (held alive
  here, so their addresses stay theirs). A call with those same tensors (``same_memory``:
  address, shape, strides, dtype) copies nothing in, even when the caller rewrote them in
  place. Any other tensors are copied into the executor's buffers.
- **output slots**: graphs that write the outputs straight into tensors of the backend's own
  (``slots`` sets). A call takes a slot no one else holds (its storages' use counts at their
  base: no tensor or view of a handed-out output is alive) and returns its tensors as they are:
  no copy. When every slot is held (the caller kept earlier outputs), the call runs on the
  executor's buffers and returns copies, as before. (A caller that keeps only an output's bare
  ``untyped_storage()`` is not seen, as in torch's own CUDA-graph trees.)

``mode``: ``"stream"`` runs the graph on the executor's stream behind a wait for the caller's
stream, and makes the caller's stream wait for it (copies in and out on the caller's stream);
``"plan"`` does the same with the copies on the executor's stream as well (the caller's stream
only waits); ``"caller"`` launches the graph on the caller's stream (no waits). A call from
another stream than the last waits for the last run first. No call synchronizes the host.
Imports torch and CuPy: used only where both run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tunedb.runtime.executor import PlanExecutor


def torch_view(a: Any, dtype: str) -> Any:
    """A torch tensor on a CuPy array's memory (bfloat16 is stored as uint16 bits; int16 crosses
    DLPack everywhere)."""
    import cupy as cp
    import torch

    if dtype == "bfloat16":
        return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def cupy_view(t: Any) -> Any:
    """A CuPy array on a torch CUDA tensor's memory, in the executor's stored form (bfloat16 as
    uint16 bits), by ``__cuda_array_interface__`` (the array holds the tensor)."""
    import cupy as cp
    import torch

    if t.dtype == torch.bfloat16:
        return cp.asarray(t.view(torch.int16)).view(cp.uint16)
    return cp.asarray(t)


def same_memory(held: Sequence[Any], given: Sequence[Any], ptrs: Sequence[int]) -> bool:
    """Whether each given tensor is the held one's memory as it was bound (``ptrs``, its address
    then): same address, shape, strides and dtype, so a graph that reads ``held`` by pointer
    reads ``given``. The held tensors stay alive, so their addresses cannot be reused."""
    for h, g, p in zip(held, given, ptrs, strict=True):
        if g.data_ptr() != p or g.shape != h.shape or g.stride() != h.stride() or g.dtype != h.dtype:
            return False
    return True


def storage_refs(t: Any) -> int:
    """References to ``t``'s storage: every tensor or view on it counts (torch's CUDA-graph
    trees judge their outputs' liveness by the same count)."""
    import torch

    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


MODES = ("stream", "plan", "caller")


class Handoff:
    """A plan's graphs for one FX graph's calls (see the module doc). ``errors`` says what could
    not be bound; ``calls`` counts calls by (inputs bound, outputs in a slot)."""

    def __init__(self, executor: PlanExecutor, names: Sequence[str], mode: str = "stream") -> None:
        import torch

        if mode not in MODES:
            raise ValueError(f"hand-off mode {mode!r}: expected one of {', '.join(MODES)}")
        self.ex, self.names, self.mode = executor, list(names), mode
        g = executor.graph
        self.outputs = list(g.outputs)
        self._in_views = [torch_view(executor.inputs[n], g.type_of(n).dtype) for n in self.names]
        self._out_views = [torch_view(executor.env[v], g.type_of(v).dtype) for v in self.outputs]
        self._plan_stream = torch.cuda.ExternalStream(executor.stream.ptr)
        self._cupy_streams: dict[int, Any] = {}  # caller's stream -> the same stream, for CuPy
        self._last_caller: Any = None  # the stream the last call came from
        # Two events recorded anew each call (torch's ``wait_stream`` makes a new one per wait):
        # a wait enqueued earlier keeps the record it saw, so reuse is safe.
        self._ev_in, self._ev_out = torch.cuda.Event(), torch.cuda.Event()
        self._graphs: dict[tuple[bool, int | None], Any] = {}
        if executor.graph_capture:
            self._graphs[(False, None)] = executor._graph
        self._held: list[Any] = []
        self._ptrs: list[int] = []
        self._slots: list[dict[str, Any]] = []  # per slot: output value -> the backend's tensor
        self._slot_base: list[list[int]] = []
        self.errors: list[str] = []
        self.calls: dict[tuple[bool, bool], int] = {}
        self.use_slots = True  # False: every call copies its outputs (benchmarks weigh the two)

    @property
    def inputs_bound(self) -> bool:
        return (True, None) in self._graphs

    @property
    def slots(self) -> int:
        return len(self._slots)

    def bind(self, example_inputs: Sequence[Any], slots: int = 2, inputs: bool = True) -> None:
        """Bind the example inputs by pointer (``inputs``) and make ``slots`` output slots, each
        with its graphs for copied and bound inputs; what fails is noted in ``errors`` and left
        to the copying path."""
        import torch

        if (False, None) not in self._graphs:
            self.errors.append(f"no CUDA graph to bind ({self.ex.capture_error})")
            return
        torch.cuda.synchronize()  # the example inputs are complete before the bound eager runs
        bound: dict[str, Any] = {}
        if inputs:
            try:
                bound = {n: cupy_view(t.detach()) for n, t in zip(self.names, example_inputs)}
                self._graphs[(True, None)] = self.ex.bind(bound)
                self._held = list(example_inputs)  # keeps the addresses theirs
                self._ptrs = [t.data_ptr() for t in self._held]
            except Exception as e:  # noqa: BLE001 - the copying path stays
                bound = {}
                self.errors.append(f"inputs: {_one_line(e)}")
        types = self.ex.graph.type_map
        for k in range(slots):
            try:
                tensors = {v: torch.empty(types[v].shape, dtype=getattr(torch, types[v].dtype),
                                          device=self._out_views[0].device)
                           for v in dict.fromkeys(self.outputs)}
                # The base: our tensor alone. Counted later it could include a transient view
                # of ours (the CuPy arrays below die with the rebuilt launches), and a held
                # output would then look free.
                base = [storage_refs(t) for t in tensors.values()]
                arrays = {v: cupy_view(t) for v, t in tensors.items()}
                made = {(False, k): self.ex.bind(arrays)}
                if bound:
                    made[(True, k)] = self.ex.bind({**bound, **arrays})
            except Exception as e:  # noqa: BLE001 - fewer slots: more calls copy their outputs
                self.errors.append(f"output slot {k}: {_one_line(e)}")
                break
            self._graphs.update(made)
            self._slots.append(tensors)
            self._slot_base.append(base)

    def _free_slot(self) -> int | None:
        if not self.use_slots:
            return None
        for k, (tensors, base) in enumerate(zip(self._slots, self._slot_base)):
            if all(storage_refs(t) <= b for t, b in zip(tensors.values(), base)):
                return k
        return None

    def run(self, args: Sequence[Any]) -> list[Any]:
        """One call on the user inputs ``args`` (in ``names`` order): the outputs, ordered on the
        caller's current stream."""
        import torch

        bound = self.inputs_bound and same_memory(self._held, args, self._ptrs)
        slot = self._free_slot()
        caller = torch.cuda.current_stream()
        if self._last_caller is not None and self._last_caller != caller:
            # The last run is ordered before its caller's stream only: a call from another stream
            # waits for it before writing the input buffers or replaying over its outputs.
            _after(caller, self._last_caller, self._ev_out)
        self._last_caller = caller
        for buf, t in zip(self._in_views, args):
            if t.shape != buf.shape:  # copy_ would broadcast
                raise ValueError(f"input {t.shape} does not fit the plan's {tuple(buf.shape)}")
        self.calls[(bound, slot is not None)] = self.calls.get((bound, slot is not None), 0) + 1
        graph = self._graphs.get((bound, slot))
        if graph is not None and self.mode == "caller":
            if not bound:
                self._copy_in(args, None)
            ptr = caller.cuda_stream
            if ptr not in self._cupy_streams:
                import cupy as cp

                self._cupy_streams[ptr] = cp.cuda.ExternalStream(ptr)
            graph.launch(self._cupy_streams[ptr])
            return self._outputs(slot, None)
        if self.mode == "plan":  # copies in and out on the plan's stream too
            _after(self._plan_stream, caller, self._ev_in)  # the plan's stream waits for the inputs
            with torch.cuda.stream(self._plan_stream):
                if not bound:
                    self._copy_in(args, self._plan_stream)
                self._launch(graph)
                outs = self._outputs(slot, caller)
            _after(caller, self._plan_stream, self._ev_out)  # and the caller's for the plan
            return outs
        if not bound:
            self._copy_in(args, None)
        _after(self._plan_stream, caller, self._ev_in)
        self._launch(graph)
        _after(caller, self._plan_stream, self._ev_out)
        return self._outputs(slot, None)

    def _launch(self, graph: Any) -> None:
        if graph is not None:
            graph.launch(self.ex.stream)
        else:
            self.ex.replay()  # launched eagerly: no graph was captured

    def _copy_in(self, args: Sequence[Any], stream: Any) -> None:
        """The inputs into the executor's buffers on torch's current stream; when that is the
        plan's (``stream``), the caller's tensors are marked used there, so that their memory
        is not handed out again before the copies ran."""
        for buf, t in zip(self._in_views, args):
            buf.copy_(t)  # casts as the executor would (int64 ids)
            if stream is not None:
                t.record_stream(stream)

    def _outputs(self, slot: int | None, caller: Any) -> list[Any]:
        """The slot's tensors, or copies of the executor's outputs made on torch's current
        stream (marked used on ``caller``'s when that is another)."""
        import torch

        if slot is not None:  # new tensors on the slot's storage: while any lives, the slot is held
            return [self._slots[slot][v].detach() for v in self.outputs]
        # Copies: the next call overwrites the executor's buffers.
        outs = [y.clone(memory_format=torch.contiguous_format) for y in self._out_views]
        if caller is not None:
            for y in outs:
                y.record_stream(caller)
        return outs


def _after(waiting: Any, done: Any, event: Any) -> None:
    """Work enqueued on ``waiting`` from now on runs after what ``done`` holds now."""
    event.record(done)
    waiting.wait_event(event)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]
