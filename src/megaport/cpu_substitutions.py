"""The CPU substitutions: what lets upstream's CUDA-only plumbing run on a machine without a GPU.

Upstream's training loop is written for a GPU: it sets the device, builds NCCL process groups,
places tensors with ``device=torch.cuda.current_device()`` and ``.cuda()``, seeds and forks the
CUDA generator, times with CUDA events, and reads CUDA memory counters. None of that is the port's
code. On a machine without a GPU (either torch build: the CPU wheel, or a CUDA wheel with no
device) exactly that plumbing is replaced, and nothing in ``megatron/``: every computation,
including everything a series changes, is the tree's own.

Each substitution is one row of :data:`REGISTRY`: a small function whose docstring says why,
recording every attribute it replaces. A profile (:data:`PROFILES`) names the rows one kind of
process installs and the lines it reports:

- ``training``: the training run (``python -m megaport.train.launch --cpu``, under torchrun), with
  ``placement-mode`` entered around the script; its lines are printed as ``> megaport cpu:``;
- ``deepspeed``: a Megatron-DeepSpeed tree's training run adds DeepSpeed's CUDA accelerator;
- ``placement`` and ``megatron-plumbing``: megaport's harness on megatron.core's builders, and the
  smoke suite's grad-norm helpers (``placement`` only), for as long as the call runs;
- ``process-group``: the smoke suite's one-rank process group and each rank of its 2-rank run;
- ``fork-checks``: the smoke suite's own processes, for a fork tree (its import-time CUDA tensors).

:func:`install` applies the rows of the profiles that are not applied yet (installing twice
changes nothing) and returns an :class:`Installed`: the lines to report, and ``undo()`` for the
rows that call applied (also on leaving a ``with`` block). :func:`undo` takes back every row
applied in this process, the last first: each attribute is again the very object it was, or
absent again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import time
import types
from typing import Callable

MARK = "> megaport cpu:"
#: What torch.cuda.get_device_capability() answers on ROCm's MI300X (gfx942).
TARGET_CAPABILITY = (9, 4)
#: torch's switch that makes torch.compile run its functions as written (read at each call; torch
#: 2.13's TORCH_COMPILE_DISABLE is read once, at torch._dynamo's import)
DYNAMO_DISABLE = "TORCHDYNAMO_DISABLE"
LEGACY_CONSTRUCTORS = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
                       "ShortTensor", "IntTensor", "LongTensor", "BoolTensor")


class Patch:
    """The attributes one row replaced, each with the object it replaced: undo() puts back the very objects."""

    def __init__(self) -> None:
        self._steps: list = []

    def set(self, owner, name: str, value) -> None:
        """``owner.name = value``; undone to the owner's own object, or to no attribute of its own."""
        own = getattr(owner, "__dict__", {})
        if name in own:
            saved = own[name]
            self._steps.append(lambda: setattr(owner, name, saved))
        else:
            self._steps.append(lambda: delattr(owner, name))
        setattr(owner, name, value)

    def later(self, step: Callable[[], None]) -> None:
        """Run ``step`` on undo (what is no attribute: a finder step, a mode on torch's stack)."""
        self._steps.append(step)

    def undo(self) -> None:
        while self._steps:
            self._steps.pop()()


#: name -> the row's function ``(patch, torch) -> None``; its docstring's first line says why.
REGISTRY: dict[str, Callable] = {}


def substitution(name: str):
    """Register a row under ``name``."""

    def register(function):
        REGISTRY[name] = function
        return function

    return register


def why(name: str) -> str:
    """The row's one line: why upstream needs it on the CPU."""
    return (REGISTRY[name].__doc__ or "").strip().splitlines()[0]


# ---------------------------------------------------------------------------------------------
# The stand-ins the rows put in place.
# ---------------------------------------------------------------------------------------------


class HostEvent:
    """``torch.cuda.Event`` on the host clock: what upstream's timers need of it."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return 1000.0 * (end.t - self.t)


class _AnyIndex(tuple):
    """``torch.cuda.default_generators``: the CPU generator at every index, 'cpu' included (what
    ``current_device()`` answers here)."""

    def __new__(cls, generator):
        return super().__new__(cls, (generator,))

    def __getitem__(self, index):
        return super().__getitem__(0)


def _host_stream_class(torch):
    class HostStream(torch.cpu.Stream):
        """torch.cpu.Stream, whose ``record_event`` gives an event (torch's gives None): MoE's
        all-to-all dispatcher (2025-12 on) synchronizes on the event its copy stream records."""

        def record_event(self, event=None):
            event = HostEvent() if event is None else event
            event.record(self)
            return event

        def synchronize(self):
            pass

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            pass

    return HostStream


def _on_gpu(torch, value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


def placement_mode(torch):
    """A TorchFunctionMode that keeps upstream's GPU placements on the CPU: ``device='cuda'``/index
    arguments and ``.to('cuda')`` stay on the CPU, ``pin_memory=True`` is dropped (2024's CP RoPE
    slicing pins its index), ``Tensor.type()`` names CPU tensors
    ``torch.cuda.*`` for upstream's type checks, and ``torch.histc`` of integers (CUDA has it, the
    CPU not; 2024's MoE router counts tokens per expert with it) counts on a float copy, the counts
    in the input's dtype (exact below 2^24)."""
    from torch.overrides import TorchFunctionMode

    class ToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                # Upstream's type checks ask for 'torch.cuda.BFloat16Tensor' and the like.
                return func(*args).replace("torch.", "torch.cuda.", 1)
            if _on_gpu(torch, kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):  # pinning needs a GPU driver; the host copy is the tensor itself
                kwargs["pin_memory"] = False
            if func is torch.Tensor.to and len(args) > 1 and _on_gpu(torch, args[1]):
                args = (args[0], "cpu") + tuple(args[2:])
            if func in (torch.histc, torch.Tensor.histc) and args and not args[0].is_floating_point():
                return func(args[0].double(), *args[1:], **kwargs).to(args[0].dtype)
            return func(*args, **kwargs)

    return ToCpu()


def placement_in_backward(patch: Patch, torch, make_mode) -> None:
    """The backward of every Python autograd function (``BackwardCFunction.apply``) runs under a
    fresh ``make_mode()``."""
    function = torch.autograd.function.BackwardCFunction
    real = function.apply

    def apply(self, *args):
        with make_mode():
            return real(self, *args)

    patch.set(function, "apply", apply)


def _to_the_tree(real, answer):
    """``answer`` for calls from the tree's code, ``real`` for torch's own: torch.compile (upstream's
    jit_fuser) must keep seeing that there is no GPU, or it initialises CUDA and fails."""

    def query(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return real(*args, **kwargs) if caller.split(".")[0] == "torch" else answer(*args, **kwargs)

    return query


def _host_properties():
    """What upstream reads of ``torch.cuda.get_device_properties`` (name, capability, memory, units)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    major, minor = TARGET_CAPABILITY
    return types.SimpleNamespace(name="CPU", major=major, minor=minor, total_memory=memory,
                                 multi_processor_count=os.cpu_count() or 1, gcnArchName="")


class _Done:
    """The work of a collective already done: what ``async_op=True`` callers wait on."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _ints(sizes):
    """Split sizes as a list of ints: on a GPU upstream's MoE dispatcher moves its CUDA split tensors to
    the host as numpy arrays (``maybe_move_tensor_to_cpu``); on the CPU they stay tensors, which torch's
    binding refuses."""
    return None if sizes is None else [int(size) for size in sizes]


def _collectives(torch) -> dict:
    """Stand-ins for what NCCL/RCCL do and gloo (torch 2.13) refuses, each by a collective gloo has: split
    sizes given as tensors, ``all_to_all``/``all_gather`` lists of uneven shapes, and the one-tensor
    all-gather of an input that requires grad. Even lists go to torch's own."""
    dist = torch.distributed
    real_single, real_lists, real_gather = dist.all_to_all_single, dist.all_to_all, dist.all_gather
    real_into = dist.all_gather_into_tensor

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return real_single(output, input, _ints(output_split_sizes), _ints(input_split_sizes), group=group,
                           async_op=async_op)

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        tensors = [*output_tensor_list, *input_tensor_list]
        if all(t.shape == tensors[0].shape for t in tensors):
            return real_lists(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
        # Uneven: one all_to_all_single of the flattened tensors, split by their sizes.
        send = torch.cat([t.reshape(-1) for t in input_tensor_list])
        sizes = [t.numel() for t in output_tensor_list]
        received = send.new_empty(sum(sizes))
        real_single(received, send, sizes, [t.numel() for t in input_tensor_list], group=group)
        for out, part in zip(output_tensor_list, received.split(sizes)):
            out.copy_(part.view(out.shape))
        return _Done() if async_op else None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return real_gather(tensor_list, tensor, group=group, async_op=async_op)
        # Uneven: every rank's tensor padded to the largest, gathered into one, cut back to each size.
        most = max(t.numel() for t in tensor_list)
        padded = tensor.new_zeros(most)
        padded[:tensor.numel()] = tensor.reshape(-1)
        gathered = tensor.new_empty(len(tensor_list) * most)
        real_into(gathered, padded, group=group)
        for out, part in zip(tensor_list, gathered.split(most)):
            out.copy_(part[:out.numel()].view(out.shape))
        return _Done() if async_op else None

    real_base = getattr(dist, "_all_gather_base", None)

    def _all_gather_base(output_tensor, input_tensor, group=None, async_op=False):
        # gloo gathers into views of the output (chunk) and refuses that under autograd when the
        # input requires grad: 2022's pipelines send recv buffers made with requires_grad=True
        # through it (scatter-gather at TP2xPP2); NCCL's collective is no autograd op either
        with torch.no_grad():
            return real_base(output_tensor, input_tensor, group=group, async_op=async_op)

    stand_ins = {"all_to_all_single": all_to_all_single, "all_to_all": all_to_all, "all_gather": all_gather}
    return {**stand_ins, "_all_gather_base": _all_gather_base} if real_base is not None else stand_ins


# ---------------------------------------------------------------------------------------------
# The rows: torch.
# ---------------------------------------------------------------------------------------------


@substitution("gloo")
def _gloo(patch: Patch, torch) -> None:
    """The CPU has no NCCL: nccl/rccl process groups are gloo's, NCCL-only options dropped.

    The default group, and those upstream creates with an explicit backend (2025's pipeline groups)."""
    dist = torch.distributed
    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("pg_options", None)
        kwargs.pop("device_id", None)
        return init("gloo" if backend in (None, "nccl", "rccl") else backend, *args, **kwargs)

    def gloo_group(*args, **kwargs):
        kwargs.pop("pg_options", None)
        if kwargs.get("backend") in ("nccl", "rccl"):
            kwargs["backend"] = "gloo"
        return new_group(*args, **kwargs)

    patch.set(dist, "init_process_group", init_process_group)
    patch.set(dist, "new_group", gloo_group)
    patch.set(dist.distributed_c10d, "new_group", gloo_group)


@substitution("gloo-send-buffers")
def _gloo_send_buffers(patch: Patch, torch) -> None:
    """A pending gloo send keeps its buffer, as NCCL's does: upstream frees a pipeline stage's sent
    output before the send completes (``deallocate_output_tensor``: ``out.data = torch.empty(1)``).

    On a GPU the caching allocator holds the freed block for the NCCL stream until the send is done;
    on the CPU the memory went back at once and gloo sent what reused it: core 0.7's interleaved
    pipeline (pp2-vpp, bf16) got NaN grad norms from iteration 1, ported and unported alike, and
    held to 1.174 once each send's storage lived until its work completed. A send inside
    ``batch_isend_irecv`` has no work of its own (the batch's works are returned together): its
    buffer is kept only until the next send, which upstream's batched path (PP > 2, waited at once)
    does not outrun."""
    dist = torch.distributed
    isend = dist.distributed_c10d.isend
    pending: list = []

    def isend_keeping_its_buffer(tensor, *args, **kwargs):
        work = isend(tensor, *args, **kwargs)
        pending[:] = [(w, kept) for w, kept in pending if w is not None and not w.is_completed()]
        pending.append((work, tensor.untyped_storage()))
        return work

    # both names: P2POp accepts only the isend its module holds (distributed_c10d._check_op)
    patch.set(dist, "isend", isend_keeping_its_buffer)
    patch.set(dist.distributed_c10d, "isend", isend_keeping_its_buffer)


@substitution("gloo-collectives")
def _gloo_collectives(patch: Patch, torch) -> None:
    """MoE's token dispatchers call collectives gloo refuses and NCCL has: stand-ins built on gloo's own.

    all_to_all_single with split sizes as CPU tensors (on a GPU they arrive as numpy arrays), all_to_all
    and all_gather lists of uneven shapes (see _collectives); gloo has uneven all_to_all_single,
    reduce_scatter_tensor and all_gather_into_tensor itself."""
    for name, function in _collectives(torch).items():
        patch.set(torch.distributed, name, function)


def _devices_of_this_node() -> int:
    """One device per rank of this node, as on a GPU box where torchrun starts a rank per GPU.

    Upstream and the fork derive the local rank as ``rank % device_count()``: the fork's 2021
    ``_initialize_distributed`` then hands it to DeepSpeed's engine, which asserts it equals torchrun's
    LOCAL_RANK (with one device, rank 1 of 2 said 0 and TP2 stopped before its first iteration).
    Read at each call: a rank forked from preloaded imports gets its LOCAL_WORLD_SIZE after the import."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@substitution("device-queries")
def _device_queries(patch: Patch, torch) -> None:
    """Upstream asks for a GPU and checks its capability: the tree's code sees one per rank of this
    node (see _devices_of_this_node), MI300X's (9, 4).

    Its name is 'CPU', its memory the host's; torch's own code still sees none (see _to_the_tree)."""
    cuda = torch.cuda
    patch.set(cuda, "is_available", _to_the_tree(cuda.is_available, lambda: True))
    patch.set(cuda, "device_count", _to_the_tree(cuda.device_count, _devices_of_this_node))
    patch.set(cuda, "get_device_name", _to_the_tree(cuda.get_device_name, lambda device=None: "CPU"))
    # The capability ROCm's torch reports for the GPUs the port targets (MI300X: gfx942, (9, 4)), so
    # upstream's capability checks pass as they do there (--moe-grouped-gemm asserts >= 8); no TE or
    # vendor kernel is there to be picked by it.
    patch.set(cuda, "get_device_capability",
              _to_the_tree(cuda.get_device_capability, lambda device=None: TARGET_CAPABILITY))
    patch.set(cuda, "get_device_properties",
              _to_the_tree(cuda.get_device_properties, lambda device=None: _host_properties()))


@substitution("current-device")
def _current_device(patch: Patch, torch) -> None:
    """Upstream passes ``torch.cuda.current_device()`` as ``device=`` (in backward too): it answers 'cpu'."""
    patch.set(torch.cuda, "current_device", lambda: "cpu")


@substitution("device-no-ops")
def _device_no_ops(patch: Patch, torch) -> None:
    """No device to select, wait for or free: set_device, synchronize, empty_cache, ipc_collect do nothing."""
    cuda = torch.cuda
    patch.set(cuda, "set_device", lambda device: None)
    patch.set(cuda, "synchronize", lambda device=None: None)
    patch.set(cuda, "empty_cache", lambda: None)
    patch.set(cuda, "ipc_collect", lambda: None)


@substitution("memory-counters")
def _memory_counters(patch: Patch, torch) -> None:
    """Upstream logs CUDA memory counters: they answer 0 (the runner reads the process's peak RSS)."""
    cuda = torch.cuda
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        patch.set(cuda, name, lambda device=None: 0)
    patch.set(cuda, "memory_stats", lambda device=None: {})
    patch.set(cuda, "reset_peak_memory_stats", lambda device=None: None)
    patch.set(cuda, "reset_max_memory_allocated", lambda device=None: None)


@substitution("tensor-cuda")
def _tensor_cuda(patch: Patch, torch) -> None:
    """Upstream moves tensors with ``.cuda()``: it returns the tensor itself."""
    patch.set(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


@substitution("legacy-constructors")
def _legacy_constructors(patch: Patch, torch) -> None:
    """2021-2023 code allocates with ``torch.cuda.*Tensor`` constructors: they build CPU tensors."""
    for name in LEGACY_CONSTRUCTORS:
        patch.set(torch.cuda, name, getattr(torch, name))


@substitution("rng")
def _rng(patch: Patch, torch) -> None:
    """Upstream seeds, saves and forks the CUDA generator: it is the CPU generator (dropout draws as on one device)."""
    cuda = torch.cuda
    seed = lambda seed: torch.random.default_generator.manual_seed(int(seed))  # noqa: E731
    get_state = lambda device="cuda": torch.get_rng_state()  # noqa: E731
    set_state = lambda state, device="cuda": torch.set_rng_state(state)  # noqa: E731
    patch.set(cuda, "manual_seed", seed)
    patch.set(cuda, "manual_seed_all", seed)
    patch.set(cuda, "get_rng_state", get_state)
    patch.set(cuda, "set_rng_state", set_state)
    patch.set(cuda, "default_generators", _AnyIndex(torch.random.default_generator))
    patch.set(cuda, "_lazy_call", lambda callable, **kwargs: callable())
    patch.set(cuda.random, "get_rng_state", get_state)
    patch.set(cuda.random, "set_rng_state", set_state)


@substitution("streams")
def _streams(patch: Patch, torch) -> None:
    """Upstream times with CUDA events and overlaps on streams: one host stream, events on the host clock,
    and no stream capturing a CUDA graph (dev 2026-08's pipeline sends ask before each batch)."""
    cuda = torch.cuda
    host_stream_class = _host_stream_class(torch)
    host_stream = host_stream_class()  # the one stream there is (torch.cpu.current_stream() has no synchronize)
    patch.set(cuda, "Stream", host_stream_class)
    patch.set(cuda, "stream", torch.cpu.stream)
    patch.set(cuda, "current_stream", lambda device=None: host_stream)
    patch.set(cuda, "default_stream", lambda device=None: host_stream)
    patch.set(cuda, "set_stream", lambda stream: None)
    patch.set(cuda, "Event", HostEvent)
    patch.set(cuda, "is_current_stream_capturing", lambda: False)


@substitution("cpu-stream")
def _cpu_stream(patch: Patch, torch) -> None:
    """megatron.core's builders ask for the current stream: torch's CPU stream (the harness's, not ``streams``)."""
    patch.set(torch.cuda, "current_stream", lambda device=None: torch.cpu.current_stream())


@substitution("nvtx")
def _nvtx(patch: Patch, torch) -> None:
    """Upstream marks NVTX ranges for the profiler: there is none, they do nothing."""
    nvtx = torch.cuda.nvtx
    patch.set(nvtx, "range_push", lambda *args, **kwargs: None)
    patch.set(nvtx, "range_pop", lambda *args, **kwargs: None)
    patch.set(nvtx, "range", lambda *args, **kwargs: contextlib.nullcontext())


@substitution("eager-compile")
def _eager_compile(patch: Patch, torch) -> None:
    """torch.compile runs its functions as written: on a CPU inductor builds C++ with the host's
    compiler in every process (upstream's ``jit_fuser`` is torch.compile from torch 2.2), which cost
    a 2-rank, 30-iteration Llama run on main 6 of its 16 s (10.3 s eager, its last loss 1e-5 apart).
    On a GPU nothing changes: the row is installed by CPU runs only."""
    saved = os.environ.get(DYNAMO_DISABLE)
    os.environ[DYNAMO_DISABLE] = "1"  # torch.compile reads it at each call

    def restore() -> None:
        if saved is None:
            os.environ.pop(DYNAMO_DISABLE, None)
        else:
            os.environ[DYNAMO_DISABLE] = saved

    patch.later(restore)


@substitution("backward-placement")
def _backward_placement(patch: Patch, torch) -> None:
    """Autograd runs a backward without the caller's function mode: each runs under a fresh placement mode.

    A GPU placement there (the fork's CheckpointFunction compares with ``torch.tensor(0).to('cuda')``)
    would otherwise reach the absent GPU."""
    placement_in_backward(patch, torch, lambda: placement_mode(torch))


@substitution("placement-mode")
def _placement_mode(patch: Patch, torch) -> None:
    """Upstream places tensors on 'cuda' by argument: the placement mode keeps them on the CPU while it is on."""
    mode = placement_mode(torch)
    mode.__enter__()
    patch.later(lambda: mode.__exit__(None, None, None))


# ---------------------------------------------------------------------------------------------
# The rows: the tree's megatron.core (the harness) and DeepSpeed (fork trees).
# ---------------------------------------------------------------------------------------------


@substitution("memory-buffer")
def _memory_buffer(patch: Patch, torch) -> None:
    """megatron.core's global memory buffer allocates on the GPU: on the CPU (after initialize_model_parallel)."""
    buffer = importlib.import_module("megatron.core.parallel_state").get_global_memory_buffer()

    def get_tensor(tensor_shape, dtype, name, *args, **kwargs):
        numel = 1
        for d in tensor_shape:
            numel *= int(d)
        held = buffer.buffer.get((name, dtype))
        if held is None or held.numel() < numel:
            held = buffer.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return held[:numel].view(*tensor_shape)

    patch.set(buffer, "get_tensor", get_tensor)


@substitution("rng-tracker-fork")
def _rng_tracker_fork(patch: Patch, torch) -> None:
    """The CUDA RNG tracker's fork() needs CUDA generators: a no-op where dropout is 0 (the harness)."""
    tracker = importlib.import_module("megatron.core.tensor_parallel").get_cuda_rng_tracker()
    patch.set(tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())


#: the modules whose ``_warmup_jit_function`` draws its warm-up inputs on the device, newest first
WARMUP_MODULES = ("megatron.training.initialize", "megatron.initialize")


@substitution("warmup-rng")
def _warmup_rng(patch: Patch, torch) -> None:
    """Upstream's JIT warm-up draws its inputs on the device (``torch.rand(..., device='cuda')``,
    sized by TP and micro-batch), from the device's generator; on the CPU that generator is the
    host's (row ``rng``), so the warm-up moved the host generator by a layout's shapes, and
    ``--use-cpu-initialization`` drew other weights in every layout (Megatron-DeepSpeed 2024-12: TP2
    and one rank 0.2 % apart in loss at iteration 1). It runs under ``torch.random.fork_rng``: the
    host generator is left as a GPU run leaves it."""
    from megaport.train.hooks import after_import, forget

    def on_import(module) -> None:
        warmup = getattr(module, "_warmup_jit_function", None)
        if warmup is None:
            return

        def host_generator_kept(*args, **kwargs):
            with torch.random.fork_rng(devices=[]):
                return warmup(*args, **kwargs)

        patch.set(module, "_warmup_jit_function", host_generator_kept)

    for name in WARMUP_MODULES:
        if name in sys.modules:
            on_import(sys.modules[name])
        else:
            after_import(name, on_import)
            patch.later(lambda name=name: forget(name, on_import))


@substitution("deepspeed-accelerator")
def _deepspeed_accelerator(patch: Patch, torch) -> None:
    """DeepSpeed's CUDA accelerator would refuse fp16/bf16 on the CPU: it answers True, its device 'cpu'.

    DS_ACCELERATOR=cuda, as on ROCm; the run's device has capability (0, 0), and the accelerator's device
    name is 'cuda:' + current_device()."""
    from megaport.train.hooks import after_import, forget

    def on_cpu(package) -> None:
        cls = getattr(importlib.import_module("deepspeed.accelerator.cuda_accelerator"), "CUDA_Accelerator", None)
        if cls is not None:
            patch.set(cls, "is_fp16_supported", lambda self: True)
            patch.set(cls, "is_bf16_supported", lambda self: True)
            patch.set(cls, "current_device_name", lambda self: "cpu")
            patch.set(cls, "device_count", lambda self: _devices_of_this_node())

    # On the package, not on cuda_accelerator itself: the port's own after-import finder (for
    # DeepSpeed's legacy tensor types) comes first on sys.meta_path and would answer for that module.
    after_import("deepspeed.accelerator", on_cpu)
    patch.later(lambda: forget("deepspeed.accelerator", on_cpu))


# ---------------------------------------------------------------------------------------------
# The profiles: which rows each kind of process installs, and what it reports.
# ---------------------------------------------------------------------------------------------


def _fork_tree(tree) -> bool:
    from megaport.deepspeed_fork import is_deepspeed_tree

    return is_deepspeed_tree(tree)


@dataclasses.dataclass(frozen=True)
class Profile:
    """The rows one kind of process installs, in order; the lines it reports for them; and, where
    it is for some trees only, which (``when(tree)``)."""

    rows: tuple
    says: tuple = ()
    when: Callable | None = None


PROFILES: dict[str, Profile] = {
    "training": Profile(
        rows=("gloo", "gloo-collectives", "gloo-send-buffers", "device-queries", "current-device", "device-no-ops",
              "memory-counters",
              "tensor-cuda", "legacy-constructors", "rng", "warmup-rng", "streams", "nvtx",
              "backward-placement", "eager-compile"),
        says=(
            "process group: backend nccl -> gloo, NCCL-only group options dropped",
            "pipeline sends: a pending gloo send keeps its buffer until it completes, as NCCL's does (upstream frees "
            "a stage's sent output at once)",
            "collectives gloo refuses (MoE dispatch): all_to_all_single split sizes given as tensors, uneven "
            "all_to_all and all_gather lists, each done with gloo's own collectives; the one-tensor all-gather of an input "
            "that requires grad (2022's pipeline recv buffers) under no_grad, as NCCL's",
            "device queries: the tree's code sees one device per rank of this node (the local rank is "
            "rank % device_count, as on a GPU box), torch's own sees none; set_device no-op; "
            "current_device() -> 'cpu'; name 'CPU', capability (9, 4) (MI300X's, so upstream's capability checks "
            "pass as there), the host's memory",
            "device placement: device='cuda'/index, .cuda(), .to('cuda') and torch.cuda.*Tensor stay on the CPU "
            "(in autograd functions' backward too)",
            "RNG: the CUDA generator is the CPU generator (seed, get/set state, tracker fork)",
            "JIT warm-up: its device draws leave the host generator as they found it (as on a GPU, whose "
            "warm-up draws from the device's generator: --use-cpu-initialization's weights as there)",
            "streams and events: CPU stream, host-clock events, no graph capture, synchronize/empty_cache no-ops, CUDA memory counters 0",
            "torch.histc of integers (CUDA-only): counted on a float copy, counts in the input's dtype",
            "torch.compile off: upstream's compiled functions (jit_fuser) run eagerly, as written (inductor's C++ "
            "build cost every CPU process seconds)",
        )),
    "placement-mode": Profile(rows=("placement-mode",)),
    "deepspeed": Profile(
        rows=("deepspeed-accelerator",), when=_fork_tree,
        says=("DeepSpeed's CUDA accelerator: is_fp16_supported()/is_bf16_supported() answer True "
              "(the CPU device of the run has capability (0, 0); ROCm GPUs have both), "
              "current_device_name() answers 'cpu', device_count() the ranks of this node (the fork's local "
              "rank is rank % device_count, which the engine checks against torchrun's LOCAL_RANK)",)),
    "placement": Profile(
        rows=("tensor-cuda", "legacy-constructors", "current-device", "cpu-stream", "placement-mode"),
        says=("tensors upstream places on 'cuda' are placed on the CPU (torch.cuda.current_device() "
              "answers 'cpu', current_stream() the CPU stream, torch.cuda.*Tensor constructors build CPU "
              "tensors), and Tensor.type() names them torch.cuda.* for upstream's type checks",)),
    "megatron-plumbing": Profile(
        rows=("memory-buffer", "rng-tracker-fork"),
        says=("parallel_state GlobalMemoryBuffer on CPU", "CUDA RNG tracker fork() no-op (dropout 0)")),
    "process-group": Profile(rows=("gloo",)),
    "fork-checks": Profile(
        rows=("legacy-constructors",), when=_fork_tree,
        says=("torch.cuda.*Tensor legacy constructors build CPU tensors: the fork builds its dtype "
              "tables at import from DeepSpeed's accelerator (get_accelerator().FloatTensor(0).dtype "
              "in megatron/model/module.py, 2023-12 … 2024-04), which hands out these constructors",)),
}

#: The rows applied in this process, in the order applied, each with its record.
_APPLIED: dict[str, Patch] = {}


@dataclasses.dataclass
class Installed:
    """What one :func:`install` did: the lines its profiles report, and the rows it applied (a row
    applied before stays with whoever applied it)."""

    lines: list
    rows: list

    def tell(self, said: list) -> None:
        """Add the lines to ``said``, each once."""
        said.extend(line for line in self.lines if line not in said)

    def undo(self) -> None:
        """Take back the rows this call applied, the last first."""
        for name in reversed(self.rows):
            patch = _APPLIED.pop(name, None)
            if patch is not None:
                patch.undo()
        self.rows = []

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def install(torch, *profiles: str, tree=None) -> Installed:
    """Apply the rows of ``profiles`` (those of a profile with a ``when`` only for a ``tree`` it
    holds for) that are not applied yet."""
    installed = Installed(lines=[], rows=[])
    for name in profiles:
        profile = PROFILES[name]
        if profile.when is not None:
            if tree is None:
                raise TypeError(f"the {name!r} CPU substitutions are for some trees only: pass tree=")
            if not profile.when(tree):
                continue
        for row in profile.rows:
            if row not in _APPLIED:
                _apply(row, torch)
                installed.rows.append(row)
        installed.lines.extend(profile.says)
    return installed


def _apply(row: str, torch) -> None:
    """Apply one row; one that fails part way is taken back before the error goes on."""
    patch = Patch()
    try:
        REGISTRY[row](patch, torch)
    except BaseException:
        patch.undo()
        raise
    _APPLIED[row] = patch


def undo() -> None:
    """Take back every row applied in this process, the last first."""
    for name in reversed(list(_APPLIED)):
        _APPLIED.pop(name).undo()
