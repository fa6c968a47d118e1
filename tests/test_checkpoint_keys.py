"""A checkpoint written with TransformerEngine's key spelling loads into the ported tree (rocm_port's
``checkpoint_keys``): where upstream's TE layer spec fuses a norm into the linear after it (the MoE
layer's pre-MLP norm, MLA's q/kv norms) and the local spec the port builds keeps it apart.

The unit tests give the port's table shards and a checkpoint's chunks; the ported-tree tests save a
tiny Mixtral-style and DeepSeek-style model, respell its keys as TE's spec does (the map read from
upstream's own ModelOpt spec in the tree: tests/support/te_keys_check.py) and load them back with
identical weights; with the table dropped (a planted fault) that load fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from support.faults import CHECKPOINT_FAULTS, plant  # noqa: E402
from support.port import load as _load  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
CHECK = Path(__file__).resolve().parent / "support" / "te_keys_check.py"
MODULE = "megatron.core.dist_checkpointing.serialization"


@pytest.fixture()
def rp():
    module = _load(None)
    yield module
    module.uninstall_import_blocker()


def _shard(key: str, layer: int | None = None):
    """A ShardedTensor as the load sees it: stacked along the layers (``layer``) or not."""
    offset = (layer, 0) if layer is not None else (0,)
    return types.SimpleNamespace(key=key, global_offset=offset, prepend_axis_num=int(layer is not None))


def test_a_moe_layers_pre_mlp_norm_is_read_in_tes_spelling(rp):
    """The local spec writes the MoE layer's pre-MLP norm as TE's fused fc1 norm; TE keeps it apart."""
    shards = {f"decoder.layers.{i}.pre_mlp_layernorm.weight": _shard("decoder.layers.mlp.linear_fc1.layer_norm_weight", i)
              for i in range(2)}
    saved = {"decoder.layers.pre_mlp_layernorm.weight": [(0, 0), (1, 0)]}
    changed = rp.checkpoint_keys.respell(shards, saved)
    assert [s.key for s in shards.values()] == ["decoder.layers.pre_mlp_layernorm.weight"] * 2
    assert [(row.local, read) for row, read, _ in changed] == [("pre_mlp_layernorm.", "decoder.layers.pre_mlp_layernorm.weight")] * 2


def test_each_layer_reads_the_spelling_its_own_shard_has(rp):
    """DeepSeek's dense first layer: TE fuses its pre-MLP norm, its MoE layers do not. The checkpoint
    holds one key per spelling, each with its layers' chunks; each shard reads the key that has it."""
    shards = [_shard("decoder.layers.mlp.linear_fc1.layer_norm_weight", i) for i in range(3)]
    saved = {"decoder.layers.mlp.linear_fc1.layer_norm_weight": [(0, 0)],
             "decoder.layers.pre_mlp_layernorm.weight": [(1, 0), (2, 0)]}
    rp.checkpoint_keys.respell({"model": shards}, saved)
    assert [s.key for s in shards] == ["decoder.layers.mlp.linear_fc1.layer_norm_weight"] + \
        ["decoder.layers.pre_mlp_layernorm.weight"] * 2


def test_mla_norms_read_from_the_up_projections_and_back(rp):
    te = {"decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight": None,
          "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight": None}
    shards = [_shard("decoder.layers.0.self_attention.q_layernorm.weight"),
              _shard("decoder.layers.0.self_attention.kv_layernorm.weight")]
    rp.checkpoint_keys.respell(shards, te)
    assert [s.key for s in shards] == list(te)
    local = {"decoder.layers.0.self_attention.q_layernorm.weight": [(0,)]}  # the reverse: TE's keys asked for
    shard = _shard("decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight")
    rp.checkpoint_keys.respell([shard], local)
    assert shard.key == "decoder.layers.0.self_attention.q_layernorm.weight"


def test_a_key_the_checkpoint_has_or_cannot_match_is_left_as_it_is(rp):
    shards = [_shard("decoder.layers.mlp.linear_fc1.layer_norm_weight", 0), _shard("decoder.layers.mlp.router.weight", 0)]
    saved = {"decoder.layers.mlp.linear_fc1.layer_norm_weight": [(0, 0)],
             "decoder.layers.pre_mlp_layernorm.weight": [(0, 0)]}
    assert rp.checkpoint_keys.respell(shards, saved) == []
    assert [s.key for s in shards] == ["decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.router.weight"]


def test_the_load_reads_a_torch_dist_checkpoint_in_either_spelling_and_says_so_once(rp, tmp_path, capsys):
    """The after-import step on dist_checkpointing's load: the checkpoint's own metadata decides."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    asked = []
    module = types.ModuleType(MODULE)
    module.load = lambda sharded_state_dict, checkpoint_dir, *args, **kwargs: asked.append(
        [s.key for s in sharded_state_dict.values()])
    for step in rp.after_import_steps(MODULE):
        step(module)
    for _ in range(2):
        module.load({"w": _shard("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")}, tmp_path)
    assert asked == [["decoder.layers.0.pre_mlp_layernorm.weight"]] * 2
    said = [line for line in capsys.readouterr().out.splitlines() if "spells" in line]
    assert said == ["> ROCm port: the checkpoint spells 1 weights as the other layer spec does (TransformerEngine's "
                    "fused norms or the local spec's separate ones): the pre-MLP norm (MoE layers, and MLA's dense "
                    "layers): read as 'pre_mlp_layernorm.', written as 'mlp.linear_fc1.layer_norm_'"]


# -- a ported tree, in-process on one gloo rank ---------------------------------------------------
def _check(tree: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("psutil", reason="upstream's checkpoint writer needs psutil (the test extra installs it)")
    with socket.socket() as probe:  # a free port for its gloo store
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tree)]), "MASTER_PORT": port}
    return subprocess.run([sys.executable, "-m", "megaport.train.launch", "--cpu", str(CHECK), str(tmp_path / "ckpt"),
                           "moe", "mla"], cwd=tree, env=env, capture_output=True, text=True, timeout=600)


def _assert_loads_tes_spelling(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    respelled = {k: v for kind in result.values() for k, v in kind["respelled"].items()}
    assert "decoder.layers.pre_mlp_layernorm.weight" in respelled.values()  # MoE: TE's norm apart
    assert any(v.endswith("linear_q_up_proj.layer_norm_weight") for v in respelled.values())  # MLA: TE's fused
    assert all(kind["ported"] == kind["te"] == 0.0 for kind in result.values()), result
    assert proc.stdout.count("> ROCm port: the checkpoint spells") == 2  # once per checkpoint read, not per shard


def _ported(core_upstream: Path, version: str, dest: Path) -> Path:
    from test_verify import apply

    return apply(core_upstream, version, dest)


@pytest.mark.upstream
@pytest.mark.parametrize("version", ["0.13.0", "0.16.1"])  # ModelOpt's TE maps for MoE and MLA: core 0.13 on
def test_a_ported_tree_loads_a_checkpoint_in_tes_spelling(core_upstream, tmp_path, version):
    tree = _ported(core_upstream, version, tmp_path / "tree")
    _assert_loads_tes_spelling(_check(tree, tmp_path))


@pytest.mark.upstream
def test_a_ported_tree_loads_tes_spelling_on_python_312_releases(core_upstream_py312, tmp_path):
    tree = _ported(core_upstream_py312, "0.19.2", tmp_path / "tree")
    _assert_loads_tes_spelling(_check(tree, tmp_path))


@pytest.mark.upstream
@pytest.mark.parametrize("fault", sorted(CHECKPOINT_FAULTS))
def test_the_check_fails_with_the_spelling_table_dropped(core_upstream, tmp_path, fault):
    tree = _ported(core_upstream, "0.16.1", tmp_path / "tree")
    plant(tree, fault)
    proc = _check(tree, tmp_path)
    assert proc.returncode != 0, f"TE's spelling loaded with the {fault} fault planted ({CHECKPOINT_FAULTS[fault].what})"
    assert "layer_norm_weight" in proc.stdout + proc.stderr  # the key the load could not find
