"""Nothing the port provides skips, and what an era lacks is upstream's word (issue #25, item 3).

Small fake ported trees: a git repository whose first commit stands for the unported upstream
commit and whose second is the "port", with .git/megaport/state.json recording both, as
``megaport apply`` writes them. The port's package is megaport's own source. The smoke suite
runs on them through the command ``megaport verify`` builds; each test names the old behaviour it
guards against.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from megaport.replacements import render
from megaport.cli import main
from megaport.commands import verify as verify_mod
from megaport.porttree import STATE_FILE, PatchRecord, PortState, subprocess_env
from megaport.smoke import _era, _fork, _launch, _verdicts
from support.gitrepos import commit, git, make_repo

BASE = {"megatron/__init__.py": "", "megatron/core/__init__.py": ""}
PORT = render(fully_masked_rows_are_zero=True)  # the package's files, as a tree has them
# A dependency no machine has, imported the way the fork's tokenizer imports transformers.
MISSING = "megaport_test_package_nobody_installs"


def fake_port(root: Path, upstream: dict, ported: dict, *, delete=(), files=None, lose=(),
              upstream_sha: str | None = None) -> Path:
    """A ported tree: ``upstream`` committed, then ``ported`` (minus ``delete``) on top; ``lose``
    is deleted from the work tree afterwards. state.json lists ``files`` (default: ``ported``'s)."""
    tree = root / "tree"
    sha = make_repo(tree, upstream, "upstream")
    head = commit(tree, ported, "port", delete=delete)
    for path in delete:  # git keeps no empty folders (one would import as a namespace package)
        folder = (tree / path).parent
        while folder != tree and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    for path in lose:
        (tree / path).unlink()
    state = PortState(upstream_url="file:///upstream", upstream_ref="main", upstream_sha=upstream_sha or sha,
                      series="core-0.13-0.16", branch="megaport/core-0.13-0.16", head=head,
                      patches=[PatchRecord(name="0001-port.patch", sha256="0" * 64, status="applied", commit=head)],
                      files=sorted(ported) if files is None else files)
    (tree / ".git" / STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    (tree / ".git" / STATE_FILE).write_text(state.to_json())
    return tree


def run_smoke(tree: Path, keyword: str) -> dict:
    """The smoke suite on ``tree`` as verify runs it (CPU, zero fully masked rows): the results."""
    pytest.importorskip("torch")
    results = tree.parent / "results.json"
    command = verify_mod.pytest_command(sys.executable, tree, "cpu", "zero", "core-0.13-0.16", results, None,
                                        keyword, color=False)
    proc = subprocess.run(command, cwd=tree, env=subprocess_env(tree), capture_output=True, text=True, timeout=600)
    assert results.is_file(), proc.stdout[-4000:] + proc.stderr[-2000:]
    document = json.loads(results.read_text())
    document["output"] = proc.stdout
    return document


def outcomes(document: dict) -> dict:
    return {t["name"].split("::", 1)[1]: t for t in document["tests"]}


# ---------------------------------------------------------------------------------------------
# The port's own names and modules: missing fails
# ---------------------------------------------------------------------------------------------


def test_a_tree_without_a_fused_softmax_module_fails_the_kernel_tests(tmp_path):
    """Was: the fused_softmax fixture skipped (about 56 kernel tests) where rocm_port's failed."""
    tree = fake_port(tmp_path, BASE, PORT)
    tests = outcomes(run_smoke(tree, "gradcheck"))
    assert len(tests) == 3
    for name, test in tests.items():
        assert test["outcome"] in ("failed", "error"), (name, test)
        assert "no fused_softmax module" in test["message"], test["message"]


def test_a_name_missing_from_rocm_port_fails(tmp_path):
    """Was: need(rocm_port, "FusedAdam") skipped 'not in this era'; rocm_port is the same in every era."""
    init = "megatron/core/rocm_port/__init__.py"  # the package no longer re-exports it
    without = PORT[init].replace("    FusedAdam,\n", "", 1)
    assert without != PORT[init]
    tree = fake_port(tmp_path, BASE, {**PORT, init: without})
    tests = outcomes(run_smoke(tree, "fused_adam or fused_sgd or every_name"))
    adam = tests["test_rocm_port_fused_adam_is_adamw"]
    assert adam["outcome"] == "failed" and "same in every era" in adam["message"], adam
    names = tests["test_rocm_port_has_every_name_of_the_port"]
    assert names["outcome"] == "failed" and "FusedAdam" in names["message"], names
    assert tests["test_rocm_port_fused_sgd_is_sgd"]["outcome"] == "passed"


def test_an_upstream_module_the_port_lost_fails(tmp_path):
    """Was: tree_module skipped whenever the ported tree lacked the module; now upstream decides."""
    optimizer = "megatron/core/optimizer/__init__.py"
    upstream = {**BASE, optimizer: "from torch.optim import AdamW as Adam\n"}
    tree = fake_port(tmp_path, upstream, PORT, delete=[optimizer])
    test = outcomes(run_smoke(tree, "optimizer_fallback"))["test_megatron_core_optimizer_fallback_matches_adamw"]
    assert test["outcome"] == "failed" and "the port lost it" in test["message"], test


def test_touched_files_never_skip(tmp_path):
    """Was: a touched file without an importable name, or missing from the tree, skipped."""
    ported = {**PORT, "tools/run-me.py": "print('compiles')\n", "megatron/core/lost.py": "x = 1\n"}
    tree = fake_port(tmp_path, BASE, ported, lose=["megatron/core/lost.py"])
    tests = outcomes(run_smoke(tree, "touched_module"))
    assert tests["test_touched_module_imports_without_apex[tools/run-me.py]"]["outcome"] == "passed"
    lost = tests["test_touched_module_imports_without_apex[megatron.core.lost]"]
    assert lost["outcome"] == "failed" and "missing from the tree" in lost["message"], lost
    assert tests["test_touched_module_imports_without_apex[megatron.core.rocm_port]"]["outcome"] == "passed"


def test_a_state_without_python_files_fails(tmp_path):
    """Was: 'state.json lists no .py files' skipped."""
    tree = fake_port(tmp_path, BASE, PORT, files=[])
    test = outcomes(run_smoke(tree, "touched_module"))["test_touched_module_imports_without_apex[none]"]
    assert test["outcome"] == "failed" and "lists no .py file" in test["message"], test


# The FusedScaleMaskSoftmax of upstream v2.0 (2021-01), verbatim but for comments: no AttnMaskType,
# the fusion chosen by two flags.
V2_0_FUSED_SOFTMAX = '''import torch
from megatron.core.rocm_port import ScaledMaskedSoftmax, ScaledSoftmax, ScaledUpperTriangMaskedSoftmax


class FusedScaleMaskSoftmax(torch.nn.Module):
    def __init__(self, input_in_fp16, upper_triang_mask_fusion,
                 general_mask_fusion, mask_func, softmax_in_fp32, scale):
        super(FusedScaleMaskSoftmax, self).__init__()
        self.input_in_fp16 = input_in_fp16
        self.upper_triang_mask_fusion = upper_triang_mask_fusion
        self.general_mask_fusion = general_mask_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        assert self.scale is None or softmax_in_fp32, 'softmax should be in fp32 when scaled'

    def forward(self, input, mask):
        data_size = input.size()
        assert input.dim() == 4
        if self.input_in_fp16 and data_size[-1] <= 2048 and \\
            (self.upper_triang_mask_fusion or self.general_mask_fusion) and \\
            input.size()[2] == input.size()[3]:
            scale = self.scale if self.scale is not None else 1.0
            if self.upper_triang_mask_fusion:
                input = input.view(-1, data_size[2], data_size[3])
                probs = ScaledUpperTriangMaskedSoftmax.apply(input, scale)
                probs = probs.view(*data_size)
            else:
                probs = ScaledMaskedSoftmax.apply(input, mask, scale)
        else:
            if self.input_in_fp16 and self.softmax_in_fp32:
                input = input.float()
            if self.scale is not None:
                input = input * self.scale
            mask_output = self.mask_func(input, mask)
            probs = torch.nn.Softmax(dim=-1)(mask_output)
            if self.input_in_fp16 and self.softmax_in_fp32:
                probs = probs.half()
        return probs
'''


def test_the_fused_module_of_every_era_runs(tmp_path):
    """Was: v2.0's FusedScaleMaskSoftmax (no AttnMaskType) skipped its fused-path tests; a
    signature no era has skipped too. The first now runs and passes, the second fails."""
    softmax = "megatron/model/fused_softmax.py"
    v2 = fake_port(tmp_path / "v2.0", {**BASE, softmax: V2_0_FUSED_SOFTMAX},
                   {**PORT, softmax: V2_0_FUSED_SOFTMAX})
    tests = outcomes(run_smoke(v2, "takes_the_fused_path"))
    # bf16 arrived in 2021-02: upstream v2.0 has no input_in_bf16, so those cases are not in the era.
    assert set(tests) == {"test_fused_scale_mask_softmax_takes_the_fused_path[fp16-causal]",
                          "test_fused_scale_mask_softmax_takes_the_fused_path[fp16-padding]"}
    assert all(t["outcome"] == "passed" for t in tests.values()), tests
    unknown = V2_0_FUSED_SOFTMAX.replace("softmax_in_fp32, scale):", "softmax_in_fp32, scale, new_knob):")
    odd = fake_port(tmp_path / "odd", {**BASE, softmax: unknown}, {**PORT, softmax: unknown})
    tests = outcomes(run_smoke(odd, "long_padding"))
    assert tests and all(t["outcome"] == "failed" and "new_knob" in t["message"] for t in tests.values()), tests


# ---------------------------------------------------------------------------------------------
# Era decisions: from the unported upstream commit
# ---------------------------------------------------------------------------------------------


LAYERS = "megatron/core/tensor_parallel/layers.py"
TP = {"megatron/core/tensor_parallel/__init__.py": ""}
# Upstream's layers with the feature (the flag's name in the file, as from 2022-02), the ported
# layers without it: no fusion extension bound.
LAYERS_WITH_FUSION = "# gradient_accumulation_fusion: main_grad += wgrad\nfused_weight_gradient_mlp_cuda = None\n"
LAYERS_WITHOUT = "fused_weight_gradient_mlp_cuda = None\n"
WGRAD_SELECTION = "weight_gradient_accumulation or fused_sgd"


def wgrad_deselected(document: dict) -> list:
    """The wgrad tests deselected as not in this era (the fake trees' era lacks bf16 softmax too,
    decided before -k chooses)."""
    return [n for n in document["device"].get("not_in_this_era") or [] if "weight_gradient_accumulation" in n]


def test_a_feature_the_port_dropped_is_tested_not_deselected(tmp_path):
    """Was: in_tree read the *ported* file, so a patch that dropped the text deselected the test
    ("not in this era"), invisibly to --strict. Upstream has it: the tests run and fail."""
    tree = fake_port(tmp_path, {**BASE, **TP, LAYERS: LAYERS_WITH_FUSION}, {**PORT, LAYERS: LAYERS_WITHOUT})
    document = run_smoke(tree, WGRAD_SELECTION)
    tests = outcomes(document)
    wgrad = {n: t for n, t in tests.items() if "weight_gradient_accumulation" in n}
    assert len(wgrad) == 2 and all(t["outcome"] == "failed" for t in wgrad.values()), wgrad
    assert not wgrad_deselected(document) and not document["device"].get("era_unverified")
    assert document["device"]["era_from"] == f"upstream {git(tree, 'rev-parse', 'HEAD~1')[:12]}"


def test_a_feature_upstream_lacks_is_deselected_as_not_in_this_era(tmp_path):
    """The converse: upstream's era has no such feature, whatever the ported text says."""
    tree = fake_port(tmp_path, {**BASE, **TP, LAYERS: LAYERS_WITHOUT}, {**PORT, LAYERS: LAYERS_WITH_FUSION})
    document = run_smoke(tree, WGRAD_SELECTION)
    assert len(wgrad_deselected(document)) == 2
    assert not document["device"].get("era_unverified")
    assert set(outcomes(document)) == {"test_rocm_port_fused_sgd_is_sgd"}


def test_without_the_upstream_commit_the_tree_decides_and_strict_counts_it(tmp_path):
    """Where the upstream commit cannot be read, the ported text still deselects, but the report
    lists each such decision (era_unverified) and --strict fails on it as on a skip."""
    tree = fake_port(tmp_path, {**BASE, **TP, LAYERS: LAYERS_WITHOUT}, {**PORT, LAYERS: LAYERS_WITHOUT},
                     upstream_sha="f" * 40)
    document = run_smoke(tree, WGRAD_SELECTION)
    unverified = [line for line in document["device"]["era_unverified"] if "weight_gradient_accumulation" in line]
    assert len(unverified) == 2 and all("from the ported tree" in line for line in unverified), unverified
    assert document["device"]["era_from"].startswith("the ported tree")
    relaxed = CliRunner().invoke(main, ["verify", str(tree), "--device", "cpu", "-k", WGRAD_SELECTION])
    assert relaxed.exit_code == 0, relaxed.output[-3000:]
    report = tmp_path / "verify.json"
    strict = CliRunner().invoke(main, ["verify", str(tree), "--device", "cpu", "-k", WGRAD_SELECTION, "--strict",
                                       "--json", str(report)])
    assert strict.exit_code == 1, strict.output[-3000:]
    counted = re.search(r"--strict: (\d+) era decision\(s\) taken from the ported tree", " ".join(strict.output.split()))
    written = json.loads(report.read_text())
    assert counted and int(counted.group(1)) == len(written["device"]["era_unverified"]) >= 2, strict.output[-2000:]
    assert written["summary"]["skipped"] == 0 and written["exit_code"] == 1


def test_verify_counts_era_decisions_not_taken_from_upstream():
    assert verify_mod.era_unverified(None) == []
    assert verify_mod.era_unverified({"device": {}}) == []
    assert verify_mod.era_unverified({"device": {"era_unverified": ["a", "b"]}}) == ["a", "b"]


LIVE = "def backward(g):\n    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(g)\n"
COMMENTED = "def backward(g):\n    # fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(g)\n    return g\n"


def _wgrad_tree(root: Path, upstream: str, ported: str, **kwargs) -> tuple[Path, _era.Upstream]:
    tree = fake_port(root, {**BASE, **TP, LAYERS: upstream}, {**PORT, LAYERS: ported}, **kwargs)
    return tree, _era.Upstream(tree, json.loads((tree / ".git" / STATE_FILE).read_text()))


def test_the_wgrad_fusion_era_comes_from_upstream_not_the_ported_layers(tmp_path):
    """Was: _dist_worker read the ported layers' source, so a patch that removed the wgrad call
    switched the check to the fork's "never fuses" expectations and passed."""
    tree, upstream = _wgrad_tree(tmp_path / "patched", LIVE, COMMENTED)
    assert _fork.era_fuses_wgrad(upstream, tree) == (True, None)
    smoke = types.SimpleNamespace(tree=tree, upstream=upstream, facts={})
    command = _launch.worker_command(smoke, "gloo", "cpu", tmp_path / "out")
    assert command[command.index("--wgrad-fusion") + 1] == "yes"
    assert not smoke.facts
    upstream.close()
    # The fork's own 2023-07 layers (commented out upstream): never fuses, whatever the port did.
    tree, upstream = _wgrad_tree(tmp_path / "fork", COMMENTED, LIVE)
    assert _fork.era_fuses_wgrad(upstream, tree) == (False, None)
    smoke = types.SimpleNamespace(tree=tree, upstream=upstream, facts={})
    command = _launch.worker_command(smoke, "gloo", "cpu", tmp_path / "out")
    assert command[command.index("--wgrad-fusion") + 1] == "no" and "era_unverified" not in smoke.facts
    upstream.close()


def test_a_wgrad_era_taken_from_the_ported_tree_is_unverified(tmp_path):
    tree, upstream = _wgrad_tree(tmp_path, COMMENTED, COMMENTED, upstream_sha="f" * 40)
    fuses, note = _fork.era_fuses_wgrad(upstream, tree)
    assert not fuses and "from the ported tree" in note
    smoke = types.SimpleNamespace(tree=tree, upstream=upstream, facts={})
    _launch.worker_command(smoke, "gloo", "cpu", tmp_path / "out")
    assert smoke.facts["era_unverified"] == [note]


def test_era_name_asks_upstream_before_skipping(tmp_path):
    """A name the tree's module lacks: the port lost it where upstream's copy has it (a failure),
    the era has none where upstream's has none either (a skip, saying so)."""
    path = "megatron/core/optimizer/clip_grads.py"
    tree = fake_port(tmp_path, {**BASE, path: "multi_tensor_applier = None\n"}, {**PORT, path: "\n"})
    state = json.loads((tree / ".git" / STATE_FILE).read_text())
    smoke = types.SimpleNamespace(tree=tree, upstream=_era.Upstream(tree, state))
    module = types.ModuleType("megatron.core.optimizer.clip_grads")
    module.__file__ = str(tree / path)
    with pytest.raises(pytest.fail.Exception, match="the port lost it"):
        _era.era_name(smoke, module, "multi_tensor_applier")
    with pytest.raises(pytest.skip.Exception, match="has none either"):
        _era.era_name(smoke, module, "l2_norm_impl")
    module.l2_norm_impl = len
    assert _era.era_name(smoke, module, "l2_norm_impl") is len
    smoke.upstream.close()


def test_cuda_only_is_no_excuse_for_the_ports_own_code(tmp_path):
    """Was: a 'Torch not compiled with CUDA enabled' raised in the port's code skipped on a CPU."""
    tree = tmp_path / "tree"

    def raised_in(rel: str) -> BaseException:
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("raise AssertionError('Torch not compiled with CUDA enabled')\n")
        try:
            exec(compile(path.read_text(), str(path), "exec"), {})
        except AssertionError as exc:
            return exc
        raise AssertionError("did not raise")

    assert _verdicts.cuda_only_reason(raised_in("megatron/core/clip_grads.py"), tree)
    assert _verdicts.cuda_only_reason(raised_in("megatron/core/rocm_port/softmax.py"), tree) is None


# ---------------------------------------------------------------------------------------------
# A missing upstream package: one line, wherever a test meets it
# ---------------------------------------------------------------------------------------------


def test_a_missing_upstream_package_says_one_line_everywhere(tmp_path):
    """Was: on the fork's 2023-12 trees without transformers, test_fused_layer_norm_module_matches_torch
    (which sets the fork's default args, importing its tokenizer) and the 2-rank TP tests failed
    with a bare ModuleNotFoundError while their siblings skipped. All now skip with one line."""
    fork = {
        **BASE,
        "pretrain_gpt.py": "import deepspeed\n",  # a Megatron-DeepSpeed tree
        "megatron/global_vars.py": f"from {MISSING} import AutoTokenizer\n",
        "megatron/core/parallel_state.py": "from megatron import global_vars\n",
        "megatron/core/fusions/__init__.py": "",
        "megatron/core/fusions/fused_layer_norm.py": "FusedLayerNorm = None\n",
        **TP,
        LAYERS: "from megatron import global_vars\n",
    }
    tree = fake_port(tmp_path, fork, PORT, files=["megatron/core/rocm_port/__init__.py", "megatron/global_vars.py"])
    document = run_smoke(tree, "fused_layer_norm_module or touched_module or tp2")
    tests = outcomes(document)
    line = (f"needs {MISSING}, an upstream dependency not installed here "
            f"(megatron/global_vars.py:1: from {MISSING} import AutoTokenizer)")
    skipped = {n: t["message"] for n, t in tests.items() if t["outcome"] == "skipped"}
    assert set(skipped) == {"test_touched_module_imports_without_apex[megatron.global_vars]",
                            "test_fused_layer_norm_module_matches_torch",
                            "test_column_parallel_linear_tp2_matches_unsharded[gloo]",
                            "test_row_parallel_linear_tp2_matches_unsharded[gloo]"}, tests
    assert set(skipped.values()) == {line}, skipped
    assert tests["test_touched_module_imports_without_apex[megatron.core.rocm_port]"]["outcome"] == "passed"
    assert document["summary"]["failed"] == 0, tests


@pytest.mark.parametrize("gpus, expected", [(1, ["gloo"]), (2, ["gloo", "device"])])
def test_a_machine_with_one_gpu_lists_the_device_run_instead_of_skipping_it(monkeypatch, gpus, expected):
    """On the first GPU verify (one H100) the NCCL 2-rank run skipped six tests, which --strict
    counts as failures of a machine that merely has one GPU: it is now listed, not a test."""
    import torch

    from megaport.smoke import _backend, test_distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(_backend, "distributed_backend_default", lambda tree, upstream: ("rccl", "the parser"))
    smoke = types.SimpleNamespace(gpu=True, tree=Path("."), upstream=None, facts={})
    assert test_distributed.variants(smoke) == expected
    listed = smoke.facts.get("two_rank_device_not_run", "")
    assert ("needs 2 GPUs" in listed) == (gpus == 1)
    cpu = types.SimpleNamespace(gpu=False, tree=Path("."), upstream=None, facts={})
    assert test_distributed.variants(cpu) == ["gloo"] and not cpu.facts
