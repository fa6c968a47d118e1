"""The CPU substitutions: install and undo leave torch exactly as it was, installing twice changes
nothing, and the placement reaches the backward of upstream's autograd functions.

Autograd calls a Python function's backward without the caller's TorchFunctionMode, so a GPU
placement there (the fork's CheckpointFunction.backward compares with
``torch.tensor(0).to(get_accelerator().device_name())``, 'cuda') escaped the placement mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megaport import cpu_substitutions  # noqa: E402
from megaport.train import hooks  # noqa: E402


def _owners() -> dict:
    """Everything a row replaces attributes of (the megatron and DeepSpeed rows' owners excepted)."""
    return {"torch.cuda": torch.cuda, "torch.cuda.random": torch.cuda.random, "torch.cuda.nvtx": torch.cuda.nvtx,
            "torch.Tensor": torch.Tensor, "torch.distributed": torch.distributed,
            "distributed_c10d": torch.distributed.distributed_c10d,
            "BackwardCFunction": torch.autograd.function.BackwardCFunction}


def _snapshot() -> dict:
    """Each owner's own attributes, by identity."""
    return {label: {name: id(value) for name, value in vars(owner).items()} for label, owner in _owners().items()}


def _changed(before: dict, after: dict) -> list:
    return sorted(f"{label}.{name}" for label in before for name in set(before[label]) | set(after[label])
                  if before[label].get(name) != after[label].get(name))


TORCH_PROFILES = ("training", "placement-mode", "placement", "process-group")


@pytest.fixture
def clean():
    """Nothing applied before the test, and nothing left after it."""
    assert not cpu_substitutions._APPLIED
    yield
    cpu_substitutions.undo()


def test_every_row_says_why_in_one_line():
    for name in cpu_substitutions.REGISTRY:
        assert cpu_substitutions.why(name), name
    named = {row for profile in cpu_substitutions.PROFILES.values() for row in profile.rows}
    assert named == set(cpu_substitutions.REGISTRY)


def test_install_then_undo_leaves_torch_exactly_as_it_was(clean):
    before = _snapshot()
    originals = {name: getattr(torch.cuda, name) for name in ("is_available", "current_device", "Event",
                                                             "FloatTensor", "manual_seed", "default_generators")}
    tensor_cuda, init = torch.Tensor.cuda, torch.distributed.init_process_group
    installed = cpu_substitutions.install(torch, *TORCH_PROFILES)
    assert _changed(before, _snapshot())  # it did replace things
    assert torch.cuda.current_device() == "cpu" and torch.cuda.FloatTensor is torch.FloatTensor
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.zeros(1, device="cuda").device.type == "cpu"  # the placement mode is on
    assert installed.rows and installed.lines
    cpu_substitutions.undo()
    assert _changed(before, _snapshot()) == []
    assert {name: getattr(torch.cuda, name) for name in originals} == originals
    assert all(getattr(torch.cuda, name) is value for name, value in originals.items())
    assert torch.Tensor.cuda is tensor_cuda and torch.distributed.init_process_group is init
    assert "cuda" not in vars(torch.Tensor)  # torch's own method again, not a copy of it
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")  # the placement mode is off


def test_the_trees_code_sees_a_device_per_rank_of_the_node_as_on_a_gpu_box(clean, monkeypatch):
    """The fork's 2021 tree takes its local rank as rank % device_count() and DeepSpeed's engine
    asserts it is torchrun's LOCAL_RANK: with one device, rank 1 of 2 said 0 and TP2 never started."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with cpu_substitutions.install(torch, "training"):
        assert torch.cuda.device_count() == 1  # one process, no torchrun: one device
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # read at each call: a forked rank gets it late
        assert [rank % torch.cuda.device_count() for rank in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_an_installation_undoes_what_it_applied_and_leaves_the_rest(clean):
    before = _snapshot()
    cpu_substitutions.install(torch, "process-group")
    gloo = torch.distributed.init_process_group
    with cpu_substitutions.install(torch, "training") as training:
        assert "gloo" not in training.rows  # applied before: left to whoever applied it
        assert torch.cuda.is_available()
    assert torch.distributed.init_process_group is gloo
    assert _changed(before, _snapshot()) == ["distributed_c10d.new_group", "torch.distributed.init_process_group",
                                             "torch.distributed.new_group"]


def test_installing_twice_changes_nothing(clean):
    before = _snapshot()
    first = cpu_substitutions.install(torch, "training", "placement")
    once = _snapshot()
    second = cpu_substitutions.install(torch, "training", "placement")
    assert _snapshot() == once
    assert second.rows == [] and second.lines == first.lines
    second.undo()
    assert _snapshot() == once  # the second installation applied nothing, so takes back nothing
    cpu_substitutions.undo()
    assert _changed(before, _snapshot()) == []


def test_a_row_that_fails_part_way_is_taken_back(clean, monkeypatch):
    before = _snapshot()

    def half(patch, torch):
        patch.set(torch.cuda, "current_device", lambda: "cpu")
        raise RuntimeError("half way")

    monkeypatch.setitem(cpu_substitutions.REGISTRY, "current-device", half)
    with pytest.raises(RuntimeError, match="half way"):
        cpu_substitutions.install(torch, "placement")
    cpu_substitutions.undo()
    assert _changed(before, _snapshot()) == []


def test_the_profiles_for_fork_trees_need_the_tree(clean):
    with pytest.raises(TypeError, match="tree="):
        cpu_substitutions.install(torch, "fork-checks")


def test_deepspeed_s_after_import_step_is_taken_back(clean, tmp_path):
    """The DeepSpeed row waits for deepspeed.accelerator's import; undo takes the waiting step back."""
    (tmp_path / "pretrain_gpt.py").write_text("import deepspeed\n")
    finders = list(sys.meta_path)
    installed = cpu_substitutions.install(torch, "deepspeed", tree=tmp_path)
    assert installed.rows == ["deepspeed-accelerator"] and "DeepSpeed's CUDA accelerator" in installed.lines[0]
    assert any(getattr(f, "fullname", None) == "deepspeed.accelerator" for f in sys.meta_path)
    cpu_substitutions.undo()
    assert sys.meta_path == finders


def test_forget_leaves_the_other_steps_for_the_module():
    def first(module):
        pass

    def second(module):
        pass

    hooks.after_import("megaport_test_nothing", first)
    hooks.after_import("megaport_test_nothing", second)
    hooks.forget("megaport_test_nothing", first)
    finders = [f for f in sys.meta_path if getattr(f, "fullname", None) == "megaport_test_nothing"]
    assert [f.steps for f in finders] == [[second]]
    hooks.forget("megaport_test_nothing", second)
    assert not any(getattr(f, "fullname", None) == "megaport_test_nothing" for f in sys.meta_path)


def test_before_import_steps_run_before_the_modules_own_code(tmp_path, monkeypatch):
    (tmp_path / "megaport_test_names.py").write_text("built = Declared()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def declare(module):
        module.Declared = lambda: "declared"
        seen.append("before")

    def after(module):
        seen.append(module.built)

    hooks.after_import("megaport_test_names", after)
    hooks.before_import("megaport_test_names", declare)
    try:
        import megaport_test_names

        assert megaport_test_names.built == "declared" and seen == ["before", "declared"]
    finally:
        hooks.forget("megaport_test_names", declare)
        hooks.forget("megaport_test_names", after)
        sys.modules.pop("megaport_test_names", None)
    assert not any(getattr(f, "fullname", None) == "megaport_test_names" for f in sys.meta_path)


class _Placements(torch.overrides.TorchFunctionMode):
    seen: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            self.seen.append(args[1:])
        return func(*args, **(kwargs or {}))


def _placing_in_backward(device: str):
    """An autograd function (times 2) whose backward places a tensor on ``device``, as upstream's do."""

    class PlacesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.tensor(2.0).to(device)

    return PlacesInBackward


@pytest.fixture
def patch():
    patch = cpu_substitutions.Patch()
    yield patch
    patch.undo()


def _backward_under_mode():
    _Placements.seen = []
    x = torch.ones(3, requires_grad=True)
    with _Placements():
        _placing_in_backward("cpu").apply(x).sum().backward()
    return x.grad, list(_Placements.seen)


def test_without_it_the_mode_misses_placements_in_backward():
    grad, seen = _backward_under_mode()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen == []  # what the launcher had to mend: autograd drops the mode


def test_backward_runs_under_a_fresh_placement_mode(patch):
    cpu_substitutions.placement_in_backward(patch, torch, _Placements)
    grad, seen = _backward_under_mode()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen == [("cpu",)]


def test_the_placement_mode_keeps_a_cuda_placement_in_backward_on_the_cpu(clean):
    cpu_substitutions.install(torch, "training")  # its backward-placement row
    x = torch.ones(2, requires_grad=True)
    _placing_in_backward("cuda").apply(x).sum().backward()
    assert x.grad.device.type == "cpu" and torch.equal(x.grad, torch.full((2,), 2.0))


def test_the_placement_mode_drops_pin_memory(clean):
    """Upstream's get_pos_emb_on_this_cp_rank pins its index tensor (no driver to pin with here)."""
    with cpu_substitutions.placement_mode(torch):
        index = torch.tensor([0, 3], device="cpu", pin_memory=True)
    assert index.device.type == "cpu" and index.tolist() == [0, 3]


_FORK_MODULE = '''
import torch

_FLOAT_TYPES = [torch.cuda.FloatTensor(0).dtype]
_HALF_TYPES = [torch.cuda.HalfTensor(0).dtype]
'''


def _import_fork_module(tmp_path, pretrain_source: str):
    """A tree whose module builds CUDA tensors at import, as the fork's megatron/model/module.py
    (2023-12 … 2024-04) does through DeepSpeed's accelerator, imported after the smoke suite's
    CPU substitution for that tree: (returncode, output)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text(pretrain_source)
    (tree / "fork_module.py").write_text(_FORK_MODULE)
    code = textwrap.dedent(f"""
        import sys, torch
        from megaport import cpu_substitutions
        print("substituted:", cpu_substitutions.install(torch, "fork-checks", tree={str(tree)!r}).lines or None)
        print("cpu constructors:", torch.cuda.FloatTensor is torch.FloatTensor)
        sys.path.insert(0, {str(tree)!r})
        import fork_module
        print("types:", fork_module._FLOAT_TYPES, fork_module._HALF_TYPES)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return proc.returncode, proc.stdout + proc.stderr


def test_a_fork_tree_s_import_time_cuda_tensors_are_built_on_the_cpu_in_the_checks(tmp_path):
    code, out = _import_fork_module(tmp_path, "import deepspeed\n")
    assert code == 0, out
    assert "types: [torch.float32] [torch.float16]" in out
    assert "cpu constructors: True" in out
    assert "legacy constructors build CPU tensors" in out


def test_an_upstream_tree_keeps_torch_s_cuda_constructors(tmp_path):
    """Nothing is substituted for upstream trees: torch.cuda's constructors stay torch's."""
    _, out = _import_fork_module(tmp_path, "import torch\n")
    assert "substituted: None" in out
    assert "cpu constructors: False" in out


# ---------------------------------------------------------------------------------------------
# The collectives gloo refuses (MoE's token dispatchers): two gloo ranks against each definition.
# ---------------------------------------------------------------------------------------------

WORLD = 2
#: SPLITS[s][r]: the rows rank s sends rank r (zero-size splits, to itself and to the other, included).
SPLITS = {"uneven": [[1, 2], [3, 1]], "zero-to-self": [[0, 3], [2, 0]], "one-way": [[2, 0], [0, 0]],
          "empty": [[0, 0], [0, 0]], "even": [[2, 2], [2, 2]]}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
#: GATHERED[s]: the rows rank s contributes to all_gather.
GATHERED = {"uneven": [1, 3], "one-empty": [2, 0], "even": [2, 2]}


def _rows(source: int, dest: int, count: int, dtype) -> "torch.Tensor":
    """The rows ``source`` sends ``dest``: each says where it comes from, exact in bf16."""
    values = torch.tensor([100 * source + 10 * dest + i for i in range(count)], dtype=torch.float64)
    return (values[:, None] * torch.tensor([1.0, -1.0], dtype=torch.float64)).to(dtype).reshape(count, 2)


def _a2a_single(rank, splits, dtype, as_kind, async_op) -> bool:
    dist = torch.distributed
    send = torch.cat([_rows(rank, dest, splits[rank][dest], dtype) for dest in range(WORLD)])
    want = torch.cat([_rows(source, rank, splits[source][rank], dtype) for source in range(WORLD)])
    out_sizes, in_sizes = [splits[s][rank] for s in range(WORLD)], splits[rank]
    kinds = {"list": list, "tensor": torch.tensor, "numpy": lambda sizes: torch.tensor(sizes).numpy()}
    got = torch.full_like(want, 7)
    work = dist.all_to_all_single(got, send, kinds[as_kind](out_sizes), kinds[as_kind](in_sizes), async_op=async_op)
    if async_op:
        work.wait()
    return torch.equal(got, want)


def _a2a_lists(rank, splits, dtype, async_op) -> bool:
    send = [_rows(rank, dest, splits[rank][dest], dtype) for dest in range(WORLD)]
    want = [_rows(source, rank, splits[source][rank], dtype) for source in range(WORLD)]
    got = [torch.full_like(t, 7) for t in want]
    work = torch.distributed.all_to_all(got, send, async_op=async_op)
    if async_op:
        work.wait()
    return all(torch.equal(g, w) for g, w in zip(got, want))


def _gather_list(rank, counts, dtype) -> bool:
    want = [_rows(source, 0, counts[source], dtype) for source in range(WORLD)]
    got = [torch.full_like(t, 7) for t in want]
    torch.distributed.all_gather(got, want[rank])
    return all(torch.equal(g, w) for g, w in zip(got, want))


def _gloo_s_own(rank, name, dtype) -> bool:
    """What gloo has itself (not substituted): reduce-scatter and all-gather into one tensor."""
    dist = torch.distributed
    per_rank = [_rows(source, 0, 2 * WORLD, dtype) for source in range(WORLD)]
    if name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
        got = torch.full((2, 2), 7, dtype=dtype)
        getattr(dist, name)(got, per_rank[rank].clone())
        return torch.equal(got, sum(t.double() for t in per_rank).to(dtype).chunk(WORLD)[rank])
    got = torch.full((2 * WORLD, 2), 7, dtype=dtype)
    getattr(dist, name)(got, per_rank[rank][:2].clone())
    return torch.equal(got, torch.cat([t[:2] for t in per_rank]))


def _gather_requiring_grad(rank) -> bool:
    """2022's pipeline scatter-gather: each rank's piece of a recv buffer made with requires_grad=True,
    gathered with ``_all_gather_base`` into one flat tensor."""
    piece = torch.full((3,), float(rank + 1), requires_grad=True)
    gathered = torch.empty(3 * WORLD)
    torch.distributed._all_gather_base(gathered, piece)
    # gloo under autograd refuses on some rank, and where it completes leaves the output a grad_fn
    # (WarnNotImplemented): NCCL's gathered buffer is a plain tensor
    return gathered.grad_fn is None and torch.equal(gathered, torch.cat([torch.full((3,), float(r + 1))
                                                                         for r in range(WORLD)]))


class _AllToAll(torch.autograd.Function):
    """Megatron's tensor_parallel.mappings._AllToAll: backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_sizes, in_sizes):
        ctx.sizes = (out_sizes, in_sizes)
        out = x.new_empty([int(sum(out_sizes))] + list(x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_sizes, in_sizes = ctx.sizes
        return _AllToAll.apply(grad, in_sizes, out_sizes), None, None


def _a2a_autograd(rank, splits) -> bool:
    """Under autograd, with the splits as tensors (as MoE's dispatcher has them on the CPU)."""
    out_sizes, in_sizes = torch.tensor([splits[s][rank] for s in range(WORLD)]), torch.tensor(splits[rank])
    x = torch.cat([_rows(rank, dest, splits[rank][dest], torch.float64) for dest in range(WORLD)]).requires_grad_()
    def weight(owner, count):
        return torch.arange(count * 2, dtype=torch.float64).reshape(count, 2) + 1000 * owner

    (_AllToAll.apply(x, out_sizes, in_sizes) * weight(rank, int(out_sizes.sum()))).sum().backward()
    # Rank r's output holds the rows from each source in order: the rows rank sent r are its weights there.
    want = []
    for dest in range(WORLD):
        before = sum(splits[s][dest] for s in range(rank))
        want.append(weight(dest, sum(splits[s][dest] for s in range(WORLD)))[before:before + splits[rank][dest]])
    return torch.equal(x.grad, torch.cat(want))


def _collective_cases() -> dict:
    """name -> check(rank): each collective against its definition."""
    cases = {}
    for dname, dtype in DTYPES.items():
        for sname, splits in SPLITS.items():
            for kind in ("list", "tensor", "numpy"):
                cases[f"all_to_all_single-{sname}-{dname}-{kind}"] = (
                    lambda rank, s=splits, d=dtype, k=kind: _a2a_single(rank, s, d, k, False))
            cases[f"all_to_all-{sname}-{dname}"] = lambda rank, s=splits, d=dtype: _a2a_lists(rank, s, d, False)
        for gname, counts in GATHERED.items():
            cases[f"all_gather-{gname}-{dname}"] = lambda rank, c=counts, d=dtype: _gather_list(rank, c, d)
        for name in ("reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor", "_all_gather_base"):
            cases[f"{name}-{dname}"] = lambda rank, n=name, d=dtype: _gloo_s_own(rank, n, d)
    cases["_all_gather_base-requires-grad"] = _gather_requiring_grad
    cases["all_to_all_single-uneven-async"] = lambda rank: _a2a_single(rank, SPLITS["uneven"], torch.float32,
                                                                       "tensor", True)
    cases["all_to_all-uneven-async"] = lambda rank: _a2a_lists(rank, SPLITS["uneven"], torch.float32, True)
    for sname in ("uneven", "zero-to-self"):
        cases[f"all_to_all_single-autograd-{sname}"] = lambda rank, s=SPLITS[sname]: _a2a_autograd(rank, s)
    return cases


def _collectives_rank(rank: int, port: int, out_dir: str, substituted: bool, names) -> None:
    """One gloo rank: the cases ``names``, each outcome written to ``out_dir/rank.json`` ('ok', 'wrong' or
    the error)."""
    import json
    import warnings

    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD)
    patch = cpu_substitutions.Patch()
    if substituted:
        cpu_substitutions.REGISTRY["gloo-collectives"](patch, torch)
    outcomes = {}
    cases = _collective_cases()
    for name in names:
        check = cases[name]
        try:
            outcomes[name] = "ok" if check(rank) else "wrong"
        except Exception as exc:  # noqa: BLE001 - the outcome is the error, for the test to show
            outcomes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    patch.undo()
    torch.distributed.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(outcomes, handle)


def _run_ranks(tmp_path, substituted: bool, names) -> list:
    import json
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_collectives_rank, args=(port, str(tmp_path), substituted, list(names)), nprocs=WORLD)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]


#: Without the row, gloo's answer: refused (by both ranks before any data moves), or its own.
UNSUBSTITUTED = {"all_to_all_single-uneven-float32-tensor": False, "all_to_all-uneven-bfloat16": False,
                 "all_gather-uneven-int64": False, "all_to_all_single-zero-to-self-bfloat16-list": True,
                 "reduce_scatter_tensor-bfloat16": True, "all_gather_into_tensor-bfloat16": True,
                 "_all_gather_base-requires-grad": False}


@pytest.fixture(scope="module")
def substituted_outcomes(tmp_path_factory):
    return _run_ranks(tmp_path_factory.mktemp("gloo-substituted"), True, sorted(_collective_cases()))


@pytest.mark.parametrize("case", sorted(_collective_cases()))
def test_each_collective_gives_its_definition_on_two_gloo_ranks(substituted_outcomes, case):
    assert [outcomes[case] for outcomes in substituted_outcomes] == ["ok"] * WORLD


def test_gloo_refuses_what_the_row_substitutes_and_has_the_rest(tmp_path):
    """Split sizes as tensors and uneven lists are refused; uneven all_to_all_single (zero-size splits
    too), reduce-scatter and all-gather into one tensor are gloo's own, so not substituted. (Only cases
    both ranks refuse alike: one refused by one rank alone would leave the other waiting.)"""
    outcomes = _run_ranks(tmp_path, False, UNSUBSTITUTED)
    for case, own in UNSUBSTITUTED.items():
        assert [o[case] == "ok" for o in outcomes] == [own] * WORLD, (case, [o[case] for o in outcomes])


def test_the_collectives_row_is_the_cpu_training_run_s_only():
    """A GPU run (launch without --cpu) installs no profile; the row is in no profile but training's."""
    holding = {name for name, profile in cpu_substitutions.PROFILES.items() if "gloo-collectives" in profile.rows}
    assert holding == {"training"}


@pytest.mark.parametrize("cpu", [True, False])
def test_launch_substitutes_the_collectives_only_with_cpu(tmp_path, cpu):
    script = tmp_path / "pretrain_probe.py"
    script.write_text("import sys, torch\n"
                      "print('own:', torch.distributed.all_to_all_single.__module__.startswith('torch'))\n"
                      "sys.exit(5)\n")
    args = [sys.executable, "-m", "megaport.train.launch", *(["--cpu"] if cpu else []), str(script)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert f"own: {not cpu}" in proc.stdout


def test_cpu_runs_run_torch_compile_eagerly_and_undo_gives_it_back(clean, monkeypatch):
    """Inductor's C++ build cost a 2-rank CPU run 6 of its 16 s; compiled functions run as written."""
    monkeypatch.delenv(cpu_substitutions.DYNAMO_DISABLE, raising=False)

    def traced(x, seen):
        seen.append(torch.compiler.is_compiling())
        return x * 2

    def compiled_call() -> bool:
        seen = []
        torch.compile(traced, backend="eager")(torch.ones(2), seen)
        return seen[0]

    cpu_substitutions.install(torch, "training")
    assert compiled_call() is False
    cpu_substitutions.undo()
    assert cpu_substitutions.DYNAMO_DISABLE not in os.environ
    assert compiled_call() is True


def test_the_jit_warm_up_leaves_the_host_generator_as_a_gpu_run_does(clean, tmp_path, monkeypatch):
    """Upstream's warm-up draws inputs sized by TP and micro-batch on the device; on the CPU (device
    generator = host generator) it moved the host generator by the layout's shapes, and
    --use-cpu-initialization drew another model in each layout (Megatron-DeepSpeed 2024-12)."""
    (tmp_path / "megaport_test_warmup.py").write_text(textwrap.dedent("""\
        import torch

        def _warmup_jit_function(tp_size=1):
            torch.rand(64 // tp_size, device="cuda")

        def set_jit_fusion_options(tp_size=1):
            _warmup_jit_function(tp_size)

        unwrapped = _warmup_jit_function
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cpu_substitutions, "WARMUP_MODULES", ("megaport_test_warmup",))
    monkeypatch.delitem(sys.modules, "megaport_test_warmup", raising=False)

    def drawn_after_warm_up(tp_size: int) -> float:
        torch.manual_seed(1234)
        sys.modules["megaport_test_warmup"].set_jit_fusion_options(tp_size)
        return torch.rand(1).item()

    cpu_substitutions.install(torch, "training", "placement-mode")
    import megaport_test_warmup  # noqa: F401  (imported under the rows, as the training run's script is)

    torch.manual_seed(1234)
    untouched = torch.rand(1).item()
    assert drawn_after_warm_up(1) == drawn_after_warm_up(2) == untouched
    torch.manual_seed(1234)
    sys.modules["megaport_test_warmup"].unwrapped(2)  # the warm-up as upstream wrote it
    assert torch.rand(1).item() != untouched


SENT = 1 << 22  # 16 MiB of float32: a send that is still on the wire when the next line runs


def _send_then_free_rank(rank: int, port: int, out_dir: str, substituted: bool) -> None:
    """Rank 0 sends, then frees the sent output as upstream's deallocate_output_tensor does and
    reuses the memory; rank 1 receives only once that is done (a marker file), so that the send is
    still pending when the buffer goes, and says whether what arrived is what was sent. (Receiving at
    once let an idle machine's loopback carry all 16 MiB before the free: gloo's own then passed.)"""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    patch = cpu_substitutions.Patch()
    if substituted:
        cpu_substitutions.REGISTRY["gloo-send-buffers"](patch, torch)
    outcome = "sent"
    if rank == 0:
        output = torch.full((SENT,), 7.0)
        work = torch.distributed.isend(output, 1)
        output.data = torch.empty((1,))  # upstream's pseudo-deallocation, before the send completes
        reused = [torch.full((SENT,), float("nan")) for _ in range(4)]
        (Path(out_dir) / "freed").touch()
        work.wait()
        del reused
    else:
        received = torch.empty(SENT)
        deadline = time.monotonic() + 120
        while not (Path(out_dir) / "freed").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        torch.distributed.recv(received, 0)
        outcome = "ok" if bool((received == 7.0).all()) else "wrong"
    torch.distributed.barrier()
    patch.undo()
    torch.distributed.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as handle:
        handle.write(outcome)


def _send_then_free(tmp_path, substituted: bool, patience: float) -> str:
    import socket

    tmp_path.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = torch.multiprocessing.start_processes(_send_then_free_rank, args=(port, str(tmp_path), substituted),
                                                    nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + patience
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:  # gloo waiting on a buffer the allocator took back
                for process in context.processes:
                    process.kill()
                return "hung"
    except torch.multiprocessing.ProcessExitedException as exc:  # gloo's writev of the freed block: EFAULT
        return f"died: {exc}"
    return (tmp_path / "1.txt").read_text()


def test_a_pending_gloo_send_keeps_its_buffer_as_nccls_does(tmp_path):
    """core 0.7's interleaved pipeline freed each sent output at once: on gloo the receiving stage
    got reused memory (NaN grad norms from iteration 1); NCCL's allocator holds the block."""
    assert _send_then_free(tmp_path / "kept", substituted=True, patience=300) == "ok"
    # gloo's own: the sender's rank dies writing the freed block ("writev ...: Bad address"), or the
    # receiver waits on what never comes whole (measured before the receiver waited: 10 min)
    assert _send_then_free(tmp_path / "freed", substituted=False, patience=15) != "ok"


def test_no_stream_captures_a_graph_on_the_host(clean):
    """dev 2026-08's pipeline sends ask ``is_current_stream_capturing()`` before each batch: torch's
    own asks the CUDA driver, which a machine without a GPU lacks."""
    with cpu_substitutions.install(torch, "training"):
        assert torch.cuda.is_current_stream_capturing() is False
