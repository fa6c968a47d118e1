"""MLA's core attention on ported trees (MEGAPORT_UPSTREAM_CLONE; skipped otherwise): the tree's own
local DotProductAttention, built as MLA builds it (k_channels = qk + rope head dim, v_channels = v
head dim, MLA's yarn softmax scale), against fp64 causal attention (tests/support/mla_attention_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.porting import port

pytestmark = pytest.mark.fullclone

SRC = Path(__file__).resolve().parents[1] / "src"
CHECK = Path(__file__).resolve().parent / "support" / "mla_attention_check.py"
# MLA exists from 2025-01: one main commit per series that has it, and main's newest.
REFS = [("2025-02", "9a496c976e12"), ("2025-11", "66c07b00bbd0"), ("main", "main")]


@pytest.mark.parametrize("when,ref", REFS, ids=[w for w, _ in REFS])
def test_mla_core_attention_matches_fp64_reference(full_clone, tmp_path, when, ref):
    tree = tmp_path / "tree"
    code, report, output = port(full_clone, ref, tree)
    assert code == 0, output
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tree)]), "MASTER_PORT": "29671"}
    proc = subprocess.run([sys.executable, "-m", "megaport.train.launch", "--cpu", str(CHECK)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["shape"] == result["want_shape"] == [12, 2, 4 * 16]
    assert result["relative_error"] < 1e-5, result
    assert "> ROCm port: MLA's core attention (k_channels != v_channels)" in proc.stdout
