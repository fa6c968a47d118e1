"""Against a full microsoft/Megatron-DeepSpeed clone (MEGAPORT_DEEPSPEED_CLONE; skipped otherwise).

The fork's series are first-class: every first-parent commit from its first DeepSpeed merge
(b56b50bb, 2021-07-02) to its HEAD ports with the series megaport picks, no fuzz, no conflict; each
tested ref of a fork series is chosen and applies; and the fork's HEAD, its 2023-07 upstream merge
and a 2022 commit port, import and give their era's softmax semantics.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.porting import assert_clean, assert_kernel_semantics, check_tree, port, semantics_of

from megaport.catalogue import load_catalogue
from megaport.cli import main

pytestmark = pytest.mark.fullclone

REPOSITORY = "microsoft/Megatron-DeepSpeed"
FIRST_DEEPSPEED_MERGE = "b56b50bb4728ef72c8e3586f1c9f89558f542cae"  # 2021-07-02, megatron-2.4-ds-pipe
# The fork's HEAD, its merge of upstream main (2023-07-04), and a 2022 commit (MoE support).
VERIFY_REFS = ["f4157bea", "9e72d571", "50b32515"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def fork_series():
    return [s for s in load_catalogue().series if s.repository == REPOSITORY]


def test_every_fork_commit_since_2021_07_ports_clean_or_offset(deepspeed_clone):
    head = git(deepspeed_clone, "rev-parse", "HEAD").strip()
    count = len(git(deepspeed_clone, "rev-list", "--first-parent", f"{FIRST_DEEPSPEED_MERGE}~1..{head}").split())
    result = CliRunner().invoke(main, ["drift", "--repo", str(deepspeed_clone), "--ref", head, "--last", str(count),
                                       "--series", "auto", "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    refs = json.loads(result.stdout)["refs"]
    assert len(refs) == count >= 210
    names = {s.name for s in fork_series()}
    bad = [f"{r['ref']} {r['sha'][:10]}: {r['series']} {r['status']}" for r in refs
           if r["status"] not in ("clean", "offset") or r["series"] not in names]
    assert not bad, "\n".join(bad)


def test_every_tested_fork_ref_is_chosen_and_applies(deepspeed_clone, tmp_path):
    failures = []
    for series in fork_series():
        for tested in series.tested:
            code, report, output = port(deepspeed_clone, tested.sha, tmp_path / "d", "--dry-run")
            if code != 0 or report.get("series") != series.name:
                failures.append(f"{series.name} @ {tested.label}: got {report.get('series')} ({code})")
                continue
            assert_clean(report)
    assert not failures, "\n".join(failures)


def _auto_series(clone, first: str, last: str) -> tuple:
    """The first-parent commits ``first~1..last`` and, for each, the series drift chooses and its status."""
    shas = git(clone, "rev-list", "--first-parent", "--reverse", f"{first}~1..{last}").split()
    args = ["drift", "--repo", str(clone), "--series", "auto", "--format", "json"]
    for sha in shas:
        args += ["--ref", sha]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    return shas, {r["sha"]: (r["series"], r["status"]) for r in json.loads(result.stdout)["refs"]}


def _split_at(shas: list, chosen: dict, prefix: str, before: str, after: str) -> None:
    """Every commit before the one ``prefix`` names takes ``before``, it and the later ones ``after``,
    each clean or with offsets only."""
    at = next(i for i, sha in enumerate(shas) if sha.startswith(prefix))
    assert 0 < at < len(shas)
    for i, sha in enumerate(shas):
        assert chosen[sha][0] == (before if i < at else after) and chosen[sha][1] in ("clean", "offset"), (sha, chosen[sha])


def test_the_2023_07_merge_commits_take_the_series_for_the_fork_fixes_they_lack(deepspeed_clone):
    """9e72d571 lacks the fork's 4278c0a1 and 636540a9 fixes, the commits up to 636540a9 the latter:
    each commit takes the series that carries the fixes it lacks, clean or with offsets only."""
    shas, chosen = _auto_series(deepspeed_clone, "9e72d571", "7f7cea32")
    assert len(shas) == 15 and chosen[shas[0]][0] == "mds-2023-07" and chosen[shas[0]][1] in ("clean", "offset")
    _split_at(shas[1:], chosen, "636540a9", "mds-2023-07-07", "mds-2023-07-12")


def test_the_sharded_position_table_of_cc3a94c6_splits_mds_2023_08_11(deepspeed_clone):
    """cc3a94c6 (2023-09-18) gave the sequence-parallel embedding its position table sharded over
    the TP ranks, which the sequence-parallel patches answer: the commits before it take
    mds-2023-08-11 (the whole table, no patch for it), it and those after it up to apex's RMSNorm
    take mds-2023-09."""
    shas, chosen = _auto_series(deepspeed_clone, "d9fa3022", "ef13d099")
    assert not shas[-1].startswith("cc3a94c6")
    _split_at(shas, chosen, "cc3a94c6", "mds-2023-08-11", "mds-2023-09")


def test_the_embedding_scatter_of_0d6e3793_splits_mds_2024_05(deepspeed_clone):
    """0d6e3793 (2024-09-04) turned the embedding's sequence scatter back on, which the
    sequence-parallel patches answer: the commits before it take mds-2024-05 (get_batch's split is
    the only one, no patch for it), it and those after it up to FPDT take mds-2024-09."""
    shas, chosen = _auto_series(deepspeed_clone, "1280f59c", "6acc370a")
    assert len(shas) == 7
    _split_at(shas, chosen, "0d6e3793", "mds-2024-05", "mds-2024-09")


@pytest.mark.parametrize("ref", VERIFY_REFS)
def test_fork_ports_and_gives_its_era_softmax(deepspeed_clone, ref, tmp_path, fake_cuda_modules):
    dest = tmp_path / "ported"
    code, report, output = port(deepspeed_clone, ref, dest)
    assert code == 0, output
    assert report["series"] in {s.name for s in fork_series()}
    assert_clean(report)
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    semantics = semantics_of(report["series"])
    found = check_tree(dest, fake_cuda_modules, semantics)
    assert "missing_dependency" not in found, found
    assert_kernel_semantics(found, semantics)


def _functions(path: Path, *names: str) -> dict:
    """``names`` (``Class.method`` or module-level functions) of the file at ``path``, each compiled
    alone, with stand-ins for the Megatron helpers they call; nothing else of the tree is imported."""
    import ast
    import types

    import torch

    module = ast.parse(path.read_text(encoding="utf-8"))
    found = {}
    for node in module.body:
        inner = node.body if isinstance(node, ast.ClassDef) else [node]
        for fn in (f for f in inner if isinstance(f, ast.FunctionDef)):
            name = f"{node.name}.{fn.name}" if isinstance(node, ast.ClassDef) else fn.name
            if name in names:
                found[name] = fn
    cross_entropy = types.SimpleNamespace(vocab_parallel_cross_entropy=lambda logits, labels: torch.full(
        labels.shape, 2.0))
    namespace = {"torch": torch, "tensor_parallel": cross_entropy, "mpu": cross_entropy,
                 "t5_extended_attention_mask": lambda masks: masks, "t5_position_ids": lambda ids: ids,
                 "average_losses_across_data_parallel_group": lambda losses: losses}
    exec(compile(ast.Module(list(found.values()), []), str(path), "exec"), namespace)
    return {name: namespace[fn.name] for name, fn in found.items()}


def _language_model_output(tree: Path) -> tuple:
    """What the tree's language model returns to T5Model: its outputs, then whatever MoE losses."""
    import torch

    decoder, encoder = torch.zeros(2, 4, 8), torch.zeros(2, 6, 8)
    text = (tree / "megatron/model/language_model.py").read_text(encoding="utf-8")
    if "return decoder_output, encoder_output, decoder_moe_losses, encoder_moe_losses" in text:
        return decoder, encoder, [torch.zeros(1)], [torch.zeros(1)]  # 712057c8 on: two lists
    if "return (decoder_output, encoder_output, *moe_losses)" in text:
        return decoder, encoder, torch.zeros(1), torch.zeros(1)  # 50b32515 on: one per layer
    return decoder, encoder


class _LanguageModel:
    """Returns ``outputs`` when called; 2021's T5Model reads its word embeddings' weight."""

    def __init__(self, outputs: tuple):
        import types

        self.outputs = outputs
        self.embedding = types.SimpleNamespace(word_embeddings=types.SimpleNamespace(weight=None))

    def __call__(self, *args, **kwargs):
        return self.outputs


@pytest.mark.parametrize("series", [s.name for s in fork_series()])
def test_the_forks_t5_model_gives_its_loss_func_the_loss(deepspeed_clone, series, tmp_path):
    """The fork's T5 as pretrain_t5.py runs it, at the newest tested ref of each fork series: its
    T5Model.forward over what its language model returns, into its own loss_func. Unported, it fails
    from 50b32515 (T5Model unpacks the MoE losses as outputs) and from 62791cc6 (a tuple)."""
    import types

    import torch

    dest = tmp_path / "ported"
    code, report, output = port(deepspeed_clone, load_catalogue().get(series).tested[-1].sha, dest)
    assert code == 0 and report["series"] == series, output
    forward = _functions(dest / "megatron/model/t5_model.py", "T5Model.forward")["T5Model.forward"]
    loss_func = _functions(dest / "pretrain_t5.py", "loss_func")["loss_func"]
    outputs = _language_model_output(dest)
    model = types.SimpleNamespace(post_process=True, add_encoder=True, add_decoder=True, return_moe_loss=False,
                                  fp16_lm_cross_entropy=False, language_model=_LanguageModel(outputs),
                                  lm_head=lambda hidden, weight: torch.zeros(4, 2, 16),
                                  shared_embedding_or_output_weight=lambda: None)
    labels, mask = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4)
    output = forward(model, None, None, None, None, None, tokentype_ids=None, lm_labels=labels)
    loss, logged = loss_func(mask, output)
    assert float(loss) == 2.0 and float(logged["lm loss"]) == 2.0
