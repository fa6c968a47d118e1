"""Every parallel layout verify and ``bench --train`` know, one row each: AMD's Megatron guide's
layouts (TP + SP + CP, the distributed optimizer, EP for Mixtral, interleaved pipelines, two
nodes) on 2 ranks, 4 where two dimensions meet. Adding one adds a row, never a branch."""

from __future__ import annotations

from megaport.errors import MegaportError
from megaport.train.layouts.spec import Layout
from megaport.train.torchrun import Ranks

TP2, SP = ("--tensor-model-parallel-size", "2"), ("--sequence-parallel",)
_SP_SERVED = ("the port's norm wherever upstream's torch norm refuses sequence parallelism, its parameters marked "
              "sequence_parallel so TP ranks all-reduce their gradients")
_CP_SERVED = "core attention through the port's context-parallel attention (K/V exchanged between CP ranks)"

#: the single-rank run every layout is compared with (not trained as a layout of its own)
ONE_RANK = Layout("one-rank", "one rank, nothing split", families=())

LAYOUTS = {layout.name: layout for layout in (
    Layout("tp2", "tensor parallel over 2 ranks", Ranks(2), TP2),
    Layout("tp2-sp", "tensor + sequence parallel over 2 ranks", Ranks(2), TP2 + SP,
           families=("llama", "deepseek"), served=_SP_SERVED, upstream_runs=False),
    Layout("pp2", "2 pipeline stages", Ranks(2), ("--pipeline-model-parallel-size", "2"), families=("llama",)),
    Layout("pp2-vpp", "2 pipeline stages, 2 interleaved virtual stages each", Ranks(2),
           ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
           micro_batch=1, layers=4, families=("llama",),
           refused_where=(("size should be greater than 2 with '",
                           "the era's interleaved schedule needs more than 2 pipeline stages (upstream allowed 2 on "
                           "2024-05-31, 3ee489d9ea)"),)),
    Layout("dp2-distopt", "2 data-parallel ranks, distributed optimizer, overlapped grad reduce and param gather",
           Ranks(2), ("--use-distributed-optimizer",),
           optional=(("--overlap-grad-reduce",), ("--overlap-param-gather",)), micro_batch=1, families=("llama",),
           optional_wrong_where=(("--overlap-grad-reduce", "megatron/model/distributed.py", "overlap_grad_reduce",
                                  "use_distributed_optimizer",
                                  "upstream's distributed optimizer overlaps the grad reduce from 9b8643cbf1 "
                                  "(2023-09-27): before, the DDP's overlapped all-reduce and the optimizer's own "
                                  "reduce-scatter both took the grad buffer, each divided by the data-parallel size "
                                  "(main 2023-09-11's Llama DP2 grad norm half one rank's, unported too)"),)),
    # The DeepSpeed fork's GPT trains through DeepSpeed's engine, whose ZeRO stage 1 partitions the
    # optimizer over the data-parallel ranks: the fork's distributed optimizer (--zero-stage is the
    # fork's flag; upstream's parser has none, so upstream trains dp2-distopt instead)
    Layout("dp2-zero1", "2 data-parallel ranks, DeepSpeed's ZeRO stage 1 partitioning the optimizer over them",
           Ranks(2), ("--zero-stage", "1"), micro_batch=1, families=("gpt",)),
    Layout("tp2-recompute", "tensor parallel over 2 ranks, full activation recomputation", Ranks(2),
           TP2 + ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
           families=("gpt",)),
    Layout("tp2-selective", "tensor parallel over 2 ranks, selective recomputation (core attention recomputed "
           "in backward)", Ranks(2), TP2 + ("--recompute-granularity", "selective"), families=("llama",),
           # 2022's GPT script asks for a method of full recomputation, which selective refuses beside it
           leaves_out=tuple((flag, "selective recomputation takes no recompute method (upstream refuses one)")
                            for flag in ("--recompute-method", "--activations-checkpoint-method",
                                         "--recompute-num-layers", "--checkpoint-activations"))),
    # PyTorch's FSDP2 (AMD's guide trains Llama 3 70B with it): parameters, gradients and optimizer
    # state sharded over the data-parallel ranks; upstream refuses it beside gradient-accumulation
    # fusion, which the port otherwise serves
    Layout("dp2-fsdp2", "2 data-parallel ranks, PyTorch FSDP2 sharding parameters, gradients and optimizer state",
           Ranks(2), ("--use-torch-fsdp2", "--no-gradient-accumulation-fusion"), micro_batch=1, families=("llama",),
           environment=(("CUDA_DEVICE_MAX_CONNECTIONS", "8", "upstream refuses FSDP where it is 1, which TP runs "
                                                          "want; 8 is CUDA's default"),),
           gpu_only="PyTorch's FSDP2 builds its device mesh and streams on the GPU itself, which megaport's CPU "
                    "placement does not serve"),
    Layout("cp2", "context parallel over 2 ranks (load-balanced causal split)", Ranks(2),
           ("--context-parallel-size", "2"), families=("llama",), served=_CP_SERVED, upstream_runs=False),
    Layout("ep2", "experts split over 2 ranks (2 data-parallel ranks for the dense layers)", Ranks(2),
           ("--expert-model-parallel-size", "2"), micro_batch=1, experts=True, families=("mixtral",)),
    Layout("tp2-pp2", "tensor parallel 2 x 2 pipeline stages", Ranks(4),
           TP2 + ("--pipeline-model-parallel-size", "2"), families=("gpt",)),
    Layout("tp2-cp2", "tensor + sequence parallel 2 x context parallel 2", Ranks(4),
           TP2 + SP + ("--context-parallel-size", "2"), families=("llama",), served=f"{_SP_SERVED}; {_CP_SERVED}",
           upstream_runs=False),
    Layout("ep2-tp2", "experts over 2 ranks x tensor + sequence parallel 2", Ranks(4),
           TP2 + SP + ("--expert-model-parallel-size", "2"), micro_batch=1, experts=True, families=("mixtral",),
           served=_SP_SERVED,
           upstream_runs=False),
    Layout("two-nodes", "tensor + sequence parallel across 2 nodes (one launcher each, rendezvous on 127.0.0.1)",
           Ranks(1, nodes=2), TP2 + SP, families=("llama",), served=_SP_SERVED, upstream_runs=False),
)}


#: upstream pads the vocabulary to a multiple of --make-vocab-size-divisible-by (128) times the TP
#: size; runs compared across layouts pad to this multiple whatever their TP size, so one checkpoint's
#: embedding loads in every layout (core 0.6-0.7 refuse the 384 rows one rank pads 257 tokens to
#: where TP2 has 512)
VOCAB_MULTIPLE = 128 * max(layout.tensor_parallel for layout in LAYOUTS.values())


def get(name: str) -> Layout:
    """The layout called ``name``; a one-line error listing the known ones otherwise."""
    if name == ONE_RANK.name:
        return ONE_RANK
    try:
        return LAYOUTS[name]
    except KeyError:
        raise MegaportError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}", exit_code=2) from None


def select(requested: str | None) -> list:
    """The layouts a run trains: ``requested`` (comma-separated names, ``all``, or ``none``), else all."""
    if requested is None or requested.strip() == "all":
        return list(LAYOUTS.values())
    names = [n.strip() for n in requested.split(",") if n.strip()]
    if names == ["none"]:
        return []
    return [get(n) for n in dict.fromkeys(names)]
