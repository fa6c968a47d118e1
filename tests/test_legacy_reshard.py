"""One rank's legacy checkpoint split for a layout (core 0.4-0.5, before checkpoints reshard
themselves): each rank's shards compute, summed as the era's layers sum them, what one rank computes;
experts go to their expert-parallel rank, renumbered; the files are named and argued as the era
loads them."""

from __future__ import annotations

import argparse
import os

import pytest

torch = pytest.importorskip("torch")

from megaport.train.checks import legacy_reshard  # noqa: E402

H, FFN, HEADS_ROWS, VOCAB = 8, 12, 24, 16


def _model(experts: int = 0) -> dict:
    torch.manual_seed(0)
    layer = "decoder.layers.0."
    model = {"embedding.word_embeddings.weight": torch.randn(VOCAB, H),
             layer + "input_layernorm.weight": torch.randn(H),
             layer + "self_attention.linear_qkv.weight": torch.randn(HEADS_ROWS, H),
             layer + "self_attention.linear_proj.weight": torch.randn(H, H),
             layer + "self_attention.linear_proj._extra_state": None,
             "output_layer.weight": torch.randn(VOCAB, H)}
    mlps = [f"{layer}mlp.experts.local_experts.{e}." for e in range(experts)] or [f"{layer}mlp."]
    for mlp in mlps:
        model[mlp + "linear_fc1.weight"] = torch.randn(2 * FFN, H)
        model[mlp + "linear_fc2.weight"] = torch.randn(H, FFN)
    if experts:
        model[layer + "mlp.router.weight"] = torch.randn(experts, H)
    return model


def _write(folder, model, **args) -> str:
    path = os.path.join(folder, "iter_0000002", "mp_rank_00")
    os.makedirs(path)
    torch.save({"model": model, "args": argparse.Namespace(swiglu=True, tensor_model_parallel_size=1, **args),
                "iteration": 2, "checkpoint_version": 3.0}, os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    return str(folder)


def _swiglu_mlp(x, fc1, fc2):
    """Megatron Core's MLP: fc1, then the gated unit over fc1's two halves, then fc2 (a row-parallel sum)."""
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ fc2.t()


def _load(folder, name):
    return torch.load(os.path.join(folder, "iter_0000002", name, "model_optim_rng.pt"), weights_only=False)


def test_tp2_shards_compute_what_one_rank_computes(tmp_path):
    one = _model()
    source = _write(tmp_path / "one", one)
    target = legacy_reshard.reshard(source, str(tmp_path / "tp2"), legacy_reshard.Split(tensor=2))
    ranks = [_load(target, f"mp_rank_{r:02d}") for r in range(2)]
    x = torch.randn(3, H)
    fc1, fc2 = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"
    summed = sum(_swiglu_mlp(x, r["model"][fc1], r["model"][fc2]) for r in ranks)
    assert torch.allclose(summed, _swiglu_mlp(x, one[fc1], one[fc2]), atol=1e-5)
    plain_rows = torch.cat([one[fc1].chunk(2)[0].chunk(2)[0], one[fc1].chunk(2)[1].chunk(2)[0]])
    assert torch.equal(ranks[0]["model"][fc1], plain_rows)  # rank 0: its half of the gates, then of the ups
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(torch.cat([r["model"][proj] for r in ranks], dim=1), one[proj])
    for key in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.self_attention.linear_qkv.weight"):
        assert torch.equal(torch.cat([r["model"][key] for r in ranks]), one[key])
    assert all(torch.equal(r["model"]["decoder.layers.0.input_layernorm.weight"],
                           one["decoder.layers.0.input_layernorm.weight"]) for r in ranks)
    assert [r["args"].tensor_model_parallel_size for r in ranks] == [2, 2]
    with open(os.path.join(target, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"


def test_a_row_split_of_a_gated_fc1_is_another_model(tmp_path):
    """What one initialisation split by rows gave TP2 in that era (the gates on rank 0 alone)."""
    one = _model()
    fc1, fc2 = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"
    x = torch.randn(3, H)
    rows = [legacy_reshard.tensor_shard(one[fc1], "rows", r, 2) for r in range(2)]
    cols = [legacy_reshard.tensor_shard(one[fc2], "columns", r, 2) for r in range(2)]
    summed = sum(_swiglu_mlp(x, a, b) for a, b in zip(rows, cols))
    assert not torch.allclose(summed, _swiglu_mlp(x, one[fc1], one[fc2]), atol=1e-3)


def test_experts_go_to_their_rank_renumbered_in_files_the_era_names(tmp_path):
    one = _model(experts=4)
    target = legacy_reshard.reshard(_write(tmp_path / "one", one, num_experts=4), str(tmp_path / "ep2"),
                                    legacy_reshard.Split(tensor=2, expert=2))
    names = sorted(os.listdir(os.path.join(target, "iter_0000002")))
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    second = _load(target, "mp_rank_00_001")
    key = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc2.weight"
    assert sorted(k for k in second["model"] if "local_experts" in k) == sorted(
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{n}.weight" for e in (0, 1) for n in (1, 2))
    assert torch.equal(second["model"][key.format(1)], one[key.format(3)].chunk(2, dim=1)[0])
    assert torch.equal(second["model"]["decoder.layers.0.mlp.router.weight"], one["decoder.layers.0.mlp.router.weight"])
    assert second["args"].expert_model_parallel_size == 2
    with pytest.raises(ValueError, match="4 experts do not split over 3"):
        legacy_reshard.reshard(str(tmp_path / "one"), str(tmp_path / "ep3"), legacy_reshard.Split(expert=3))


def test_the_legacy_models_nested_checkpoint_splits_as_its_layers_hold_their_shards(tmp_path):
    """main 2023-07 … 2023-10 build the legacy model alone, whose SwiGLU dense_h_to_4h holds [gate; up]
    as fc1 does: one initialisation split by rows put Llama TP2 2.1 % (loss) / 66 % (grad norm) from one
    rank. Its checkpoint nests by module; each TP rank's shard keeps the nesting and sums to one rank."""
    torch.manual_seed(1)
    layer = "layers.0."
    encoder = {layer + "input_norm.weight": torch.randn(H),
               layer + "self_attention.query_key_value.weight": torch.randn(HEADS_ROWS, H),
               layer + "self_attention.dense.weight": torch.randn(H, H),
               layer + "mlp.dense_h_to_4h.weight": torch.randn(2 * FFN, H),
               layer + "mlp.dense_4h_to_h.weight": torch.randn(H, FFN)}
    one = {"language_model": {"embedding": {"word_embeddings": {"weight": torch.randn(VOCAB, H)}},
                              "encoder": encoder, "output_layer": {"weight": torch.randn(VOCAB, H)}}}
    target = legacy_reshard.reshard(_write(tmp_path / "one", one), str(tmp_path / "tp2"), legacy_reshard.Split(tensor=2))
    ranks = [_load(target, f"mp_rank_{r:02d}")["model"]["language_model"] for r in range(2)]
    fc1, fc2 = layer + "mlp.dense_h_to_4h.weight", layer + "mlp.dense_4h_to_h.weight"
    x = torch.randn(3, H)
    summed = sum(_swiglu_mlp(x, r["encoder"][fc1], r["encoder"][fc2]) for r in ranks)
    assert torch.allclose(summed, _swiglu_mlp(x, encoder[fc1], encoder[fc2]), atol=1e-5)
    dense = layer + "self_attention.dense.weight"
    assert torch.equal(torch.cat([r["encoder"][dense] for r in ranks], dim=1), encoder[dense])
    qkv = layer + "self_attention.query_key_value.weight"
    assert torch.equal(torch.cat([r["encoder"][qkv] for r in ranks]), encoder[qkv])
    for path in (("embedding", "word_embeddings"), ("output_layer",)):
        halves = [r[path[0]][path[1]] if len(path) == 2 else r[path[0]] for r in ranks]
        whole = one["language_model"][path[0]][path[1]] if len(path) == 2 else one["language_model"][path[0]]
        assert torch.equal(torch.cat([h["weight"] for h in halves]), whole["weight"])
    assert all(torch.equal(r["encoder"][layer + "input_norm.weight"], encoder[layer + "input_norm.weight"]) for r in ranks)
