"""Context-parallel attention without TransformerEngine (replacements' context_parallel module).

2 and 4 gloo processes on 127.0.0.1 each run the CP attention on their load-balanced chunks
(rank r: chunks r and 2·cp−1−r); the gathered output and dq, dk, dv are checked against one
process's whole-sequence attention in fp64 (the global causal mask, GQA, a V head dim unlike
Q/K's, padding masks with fully masked rows, dropout with the blocks' own masks), bf16 loosely.
Planted faults (blocks merged without their log-sum-exp; query chunks given contiguous causal
offsets) must fail the same check.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import megaport.replacements as replacements  # noqa: E402
from support import cp_worker  # noqa: E402

_HERE = Path(replacements.__file__).parent
# the port package's module, the file every series carries
SOURCE = _HERE / "rocm_port" / "context_parallel.py"

FP64_TOL = 1e-10  # relative to the reference's largest magnitude
BF16_TOL = 1e-2  # measured 1.1e-3 to 1.7e-3
SHAPE = dict(batch=2, heads=4, groups=4, dk=8, dv=8)


def case(name, **kw):
    return {"name": name, "seed": len(name) * 7919 + sum(map(ord, name)), "causal": True, **SHAPE, **kw}


CASES = {
    2: [
        case("mha", seq=16),
        case("gqa", seq=16, groups=2),
        case("mqa", seq=16, groups=1),
        case("mla", seq=16, dk=12, dv=8, scale=0.3),
        case("mla-v-wider", seq=16, groups=2, dk=8, dv=12),
        case("padding-mask", seq=16, causal=False, mask=True),
        case("causal-and-mask", seq=16, mask=True),
        case("dropout", seq=16, groups=2, dropout=0.3),
        case("bf16", seq=16, groups=2, dtype="bfloat16"),
        case("fault-merge-without-lse", seq=16, fault="merge_without_lse"),
        case("fault-causal-offset", seq=16, fault="causal_offset"),
    ],
    4: [
        case("mha", seq=32),
        case("gqa-mla", seq=32, groups=2, dk=12, dv=8),
        case("dropout", seq=32, dropout=0.2),
        case("fault-merge-without-lse", seq=32, fault="merge_without_lse"),
    ],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cp_mod():
    return cp_worker.load(str(SOURCE))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """world -> the directory where every rank of one spawn of that many processes saved every case."""
    done = {}

    def spawned(world: int) -> Path:
        if world not in done:
            outdir = tmp_path_factory.mktemp(f"cp{world}")
            mp.spawn(cp_worker.run, args=(world, free_port(), str(SOURCE), CASES[world], str(outdir)),
                     nprocs=world, join=True)
            done[world] = outdir
        return done[world]

    return spawned


def gathered(outdir: Path, name: str, world: int) -> dict:
    """Every rank's local tensors put back in sequence order."""
    parts = [torch.load(outdir / f"{name}.{r}.pt") for r in range(world)]
    result = {}
    for key in parts[0]:
        chunks = [None] * (2 * world)
        for r, part in enumerate(parts):
            first, second = part[key].chunk(2)
            chunks[r], chunks[2 * world - 1 - r] = first, second
        result[key] = torch.cat(chunks)
    return result


def dropout_keep(cp_mod, spec: dict, world: int):
    """The kept-elements mask [b, heads, s, s] the ranks drew, block by block."""
    s, b, heads, groups, p = spec["seq"], spec["batch"], spec["heads"], spec["groups"], spec["dropout"]
    length = s // (2 * world)
    torch.manual_seed(spec["seed"])
    seed = int(torch.randint(1 << 62, (1,)).item())
    keep = torch.ones(b, heads, s, s, dtype=torch.bool)
    for c in range(2 * world):
        for j in range(c + 1):
            block = cp_mod._kept((b, groups, heads // groups, length, length), p, seed, c * 2 * world + j, "cpu")
            rows, cols = slice(c * length, (c + 1) * length), slice(j * length, (j + 1) * length)
            keep[..., rows, cols] = block.reshape(b, heads, length, length)
    return keep


def reference(q, k, v, *, scale, causal, mask, keep=None, dropout=0.0):
    """Whole-sequence attention in Megatron's layout; fully masked rows are zeros."""
    s, b, heads, dk = q.shape
    rep = heads // k.shape[2]
    qh = q.permute(1, 2, 0, 3)
    kh, vh = (t.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(dk) if scale is None else scale
    masked = torch.zeros(s, s, dtype=torch.bool)
    if causal:
        masked = torch.ones(s, s, dtype=torch.bool).triu(1)
    if mask is not None:
        masked = masked | mask
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    dead = masked.all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(masked & ~dead, float("-inf")), dim=-1).masked_fill(dead, 0.0)
    if keep is not None:
        probs = probs * keep / (1 - dropout)
    return torch.matmul(probs, vh).permute(2, 0, 1, 3).reshape(s, b, -1)


def errors(cp_mod, outdir, world: int, spec: dict) -> dict:
    """Largest error of output, dq, dk, dv against the fp64 reference, each relative to the
    reference's largest magnitude."""
    q, k, v, grad, mask = cp_worker.global_inputs(spec)
    if spec.get("dtype") == "bfloat16":  # the reference sees the inputs the ranks saw
        q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
        grad = grad.to(torch.bfloat16).double()
    keep = dropout_keep(cp_mod, spec, world) if spec.get("dropout") else None
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference(q, k, v, scale=spec.get("scale"), causal=spec["causal"], mask=mask, keep=keep,
                    dropout=spec.get("dropout", 0.0))
    out.backward(grad)
    expected = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    got = gathered(outdir, spec["name"], world)
    return {n: ((got[n].double() - e).abs().max() / e.abs().max()).item() for n, e in expected.items()}


def _specs(kind):
    return [pytest.param(world, spec, id=f"cp{world}-{spec['name']}") for world, specs in sorted(CASES.items())
            for spec in specs if kind(spec)]


def _run(ranks, world, spec, cp_mod):
    return errors(cp_mod, ranks(world), world, spec)


@pytest.mark.parametrize("world, spec", _specs(lambda s: not s.get("fault") and s.get("dtype") is None))
def test_matches_whole_sequence_attention_fp64(ranks, world, spec, cp_mod):
    err = _run(ranks, world, spec, cp_mod)
    assert max(err.values()) < FP64_TOL, err


@pytest.mark.parametrize("world, spec", _specs(lambda s: s.get("dtype") == "bfloat16"))
def test_bf16_close_to_fp64(ranks, world, spec, cp_mod):
    err = _run(ranks, world, spec, cp_mod)
    assert max(err.values()) < BF16_TOL, err


@pytest.mark.parametrize("world, spec", _specs(lambda s: s.get("fault")))
def test_planted_fault_fails_the_check(ranks, world, spec, cp_mod):
    """Blocks merged without their log-sum-exp, or query chunks at contiguous (unbalanced)
    causal offsets, must not pass the check the correct kernel passes."""
    err = _run(ranks, world, spec, cp_mod)
    assert err["out"] > 1e-2, err


def test_cp_comm_types(cp_mod):
    for asked in ("p2p", "a2a", "allgather", "all_gather", "a2a+p2p", ["p2p", "a2a"], None):
        served, line = cp_mod.cp_comm_type_answer(asked)
        assert served and "all-gathered" in line and "\n" not in line, line
    served, line = cp_mod.cp_comm_type_answer(["p2p", "ring"])
    assert not served and "ring" in line and "refused" in line


def test_refuses_what_it_cannot_split(cp_mod):
    q = torch.zeros(5, 1, 2, 4)
    with pytest.raises(ValueError, match="odd"):
        cp_mod.context_parallel_attention(q, q, q, group=None, causal=True)
    q = torch.zeros(4, 1, 3, 4)
    with pytest.raises(ValueError, match="divide"):
        cp_mod.context_parallel_attention(q, torch.zeros(4, 1, 2, 4), torch.zeros(4, 1, 2, 4), group=None)
