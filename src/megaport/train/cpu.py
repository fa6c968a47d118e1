"""Run a tree's own ``pretrain_gpt.py`` on the CPU: the substitutions for CUDA-only plumbing.

Upstream's training loop is written for a GPU: it sets the device, builds NCCL process groups,
places tensors with ``device=torch.cuda.current_device()`` and ``.cuda()``, seeds and forks the
CUDA generator, times with CUDA events, and reads CUDA memory counters. None of that is the port's
code. On a machine without a GPU (either torch build: the CPU wheel, or a CUDA wheel with no
device), this launcher replaces exactly that plumbing, then runs the script as ``__main__`` in one
process, as ``torchrun --nproc_per_node 1`` would:

    python -m megaport.train.cpu pretrain_gpt.py --num-layers 2 ...

What is substituted (:data:`SUBSTITUTIONS`, printed once at start as ``> megaport cpu:`` lines):

- process group: ``nccl`` becomes ``gloo``; NCCL-only group options are dropped;
- device queries: the tree's code sees one device (torch's own code still sees none), ``set_device`` is a no-op,
  ``current_device()`` answers ``'cpu'``, its name is 'CPU', its capability MI300X's (9, 4) (upstream's
  capability checks, e.g. ``--moe-grouped-gemm``'s, pass as on the ROCm GPU),
  its memory the host's;
- device placement: ``device='cuda'``/index arguments, ``.cuda()`` and ``.to('cuda')`` stay on
  the CPU, in the backward of upstream's autograd functions too (autograd runs those without the
  caller's TorchFunctionMode); ``torch.cuda.FloatTensor`` and the other legacy constructors build
  CPU tensors, and ``Tensor.type()`` names them ``torch.cuda.*`` for upstream's type checks;
- RNG: the CUDA generator *is* the CPU generator (seeding, get/set state, the RNG tracker's
  fork), so dropout under the tracker draws as it would on one device;
- streams and events: the CPU stream; events time with the host clock (a stream's
  ``record_event`` gives one); ``synchronize`` and ``empty_cache`` do nothing; memory counters
  answer 0 (the runner reads the process's peak RSS);
- ``torch.histc`` of integers (CUDA has it, the CPU not; 2024's MoE router counts tokens per
  expert with it): counted on a float copy, the counts in the input's dtype (exact below 2^24).

Nothing in ``megatron/`` is replaced: every computation, including everything a series changes,
is the tree's own.
"""

from __future__ import annotations

import contextlib
import sys
import time

SUBSTITUTIONS = (
    "process group: backend nccl -> gloo, NCCL-only group options dropped",
    "device queries: the tree's code sees one device, torch's own sees none; set_device no-op; current_device() -> 'cpu'; "
    "name 'CPU', capability (9, 4) (MI300X's, so upstream's capability checks pass as there), the host's memory",
    "device placement: device='cuda'/index, .cuda(), .to('cuda') and torch.cuda.*Tensor stay on the CPU "
    "(in autograd functions' backward too)",
    "RNG: the CUDA generator is the CPU generator (seed, get/set state, tracker fork)",
    "streams and events: CPU stream, host-clock events, synchronize/empty_cache no-ops, CUDA memory counters 0",
    "torch.histc of integers (CUDA-only): counted on a float copy, counts in the input's dtype",
)
MARK = "> megaport cpu:"
#: What torch.cuda.get_device_capability() answers on ROCm's MI300X (gfx942).
TARGET_CAPABILITY = (9, 4)
LEGACY_CONSTRUCTORS = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
           "ShortTensor", "IntTensor", "LongTensor", "BoolTensor")


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


def _on_gpu(torch, value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


def placement_mode(torch):
    """A TorchFunctionMode that keeps upstream's GPU placements on the CPU (see module docstring)."""
    from torch.overrides import TorchFunctionMode

    class ToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                # Upstream's type checks ask for 'torch.cuda.BFloat16Tensor' and the like.
                return func(*args).replace("torch.", "torch.cuda.", 1)
            if _on_gpu(torch, kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to and len(args) > 1 and _on_gpu(torch, args[1]):
                args = (args[0], "cpu") + tuple(args[2:])
            if func in (torch.histc, torch.Tensor.histc) and args and not args[0].is_floating_point():
                return func(args[0].double(), *args[1:], **kwargs).to(args[0].dtype)
            return func(*args, **kwargs)

    return ToCpu()


def placement_in_backward(torch, make_mode) -> None:
    """The backward of every Python autograd function (``BackwardCFunction.apply``) runs under a
    fresh ``make_mode()``: autograd calls it without the caller's TorchFunctionMode, so a GPU
    placement there (the fork's CheckpointFunction compares with ``torch.tensor(0).to('cuda')``)
    would otherwise reach the absent GPU."""
    function = torch.autograd.function.BackwardCFunction
    real = function.apply

    def apply(self, *args):
        with make_mode():
            return real(self, *args)

    function.apply = apply


def _to_the_tree(real, answer):
    """``answer`` for calls from the tree's code, ``real`` for torch's own: torch.compile (upstream's
    jit_fuser) must keep seeing that there is no GPU, or it initialises CUDA and fails."""

    def query(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return real(*args, **kwargs) if caller.split(".")[0] == "torch" else answer(*args, **kwargs)

    return query


def _host_properties():
    """What upstream reads of ``torch.cuda.get_device_properties`` (name, capability, memory, units)."""
    import os
    import types

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    major, minor = TARGET_CAPABILITY
    return types.SimpleNamespace(name="CPU", major=major, minor=minor, total_memory=memory,
                                 multi_processor_count=os.cpu_count() or 1, gcnArchName="")


def use_gloo(torch):
    """The process-group substitution: ``nccl``/``rccl`` process groups (the default one and the
    groups upstream creates with an explicit backend, such as 2025's pipeline groups) are gloo's,
    NCCL-only options dropped. Returns a function that undoes it (verify's one-rank fixture)."""
    dist = torch.distributed
    saved = dist.init_process_group, dist.new_group, dist.distributed_c10d.new_group
    init, new_group = saved[0], saved[1]

    def init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("pg_options", None)
        kwargs.pop("device_id", None)
        return init("gloo" if backend in (None, "nccl", "rccl") else backend, *args, **kwargs)

    def gloo_group(*args, **kwargs):
        kwargs.pop("pg_options", None)
        if kwargs.get("backend") in ("nccl", "rccl"):
            kwargs["backend"] = "gloo"
        return new_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, gloo_group
    dist.distributed_c10d.new_group = gloo_group

    def undo():
        dist.init_process_group, dist.new_group, dist.distributed_c10d.new_group = saved

    return undo


def _device_queries(torch) -> None:
    cuda = torch.cuda
    cuda.is_available = _to_the_tree(cuda.is_available, lambda: True)
    cuda.device_count = _to_the_tree(cuda.device_count, lambda: 1)
    cuda.get_device_name = _to_the_tree(cuda.get_device_name, lambda device=None: "CPU")
    # The capability ROCm's torch reports for the GPUs the port targets (MI300X: gfx942, (9, 4)), so
    # upstream's capability checks pass as they do there (--moe-grouped-gemm asserts >= 8); no TE or
    # vendor kernel is there to be picked by it.
    cuda.get_device_capability = _to_the_tree(cuda.get_device_capability, lambda device=None: TARGET_CAPABILITY)
    cuda.get_device_properties = _to_the_tree(cuda.get_device_properties, lambda device=None: _host_properties())
    cuda.set_device = lambda device: None
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.ipc_collect = lambda: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.memory_stats = lambda device=None: {}
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.reset_max_memory_allocated = lambda device=None: None


def place_on_cpu(torch) -> None:
    """``.cuda()`` returns the tensor itself; the legacy ``torch.cuda.*Tensor`` constructors build CPU tensors."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    legacy_constructors_on_cpu(torch)


def legacy_constructors_on_cpu(torch) -> None:
    """The legacy ``torch.cuda.*Tensor`` constructors build CPU tensors (``torch.FloatTensor``...)."""
    for name in LEGACY_CONSTRUCTORS:
        setattr(torch.cuda, name, getattr(torch, name))


def _rng(torch) -> None:
    cuda = torch.cuda
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: torch.random.default_generator.manual_seed(int(seed))
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.default_generators = _AnyIndex(torch.random.default_generator)
    cuda._lazy_call = lambda callable, **kwargs: callable()
    cuda.random.get_rng_state, cuda.random.set_rng_state = cuda.get_rng_state, cuda.set_rng_state


def _streams(torch) -> None:
    cuda = torch.cuda

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

    cuda.Stream = HostStream
    cuda.stream = torch.cpu.stream
    host_stream = HostStream()  # the one stream there is (torch.cpu.current_stream() has no synchronize)
    cuda.current_stream = lambda device=None: host_stream
    cuda.default_stream = lambda device=None: host_stream
    cuda.set_stream = lambda stream: None
    cuda.Event = HostEvent
    nvtx = cuda.nvtx
    nvtx.range_push = lambda *args, **kwargs: None
    nvtx.range_pop = lambda *args, **kwargs: None
    nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()


def install(torch) -> contextlib.AbstractContextManager:
    """Apply every substitution; the returned placement mode must be active while the script runs."""
    use_gloo(torch)
    _device_queries(torch)
    place_on_cpu(torch)
    _rng(torch)
    _streams(torch)
    placement_in_backward(torch, lambda: placement_mode(torch))
    return placement_mode(torch)
