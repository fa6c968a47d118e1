"""The one-rank process group of the harness and verify's own tests leaves nothing behind."""

import contextlib
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from megaport.train.process_group import one_rank_group  # noqa: E402


def _stores(prefix):
    return set(Path(tempfile.gettempdir()).glob(f"{prefix}*"))


@pytest.mark.parametrize("fails", [False, True], ids=["run-ends", "run-fails"])
def test_the_group_and_its_store_are_gone_when_the_run_ends(monkeypatch, tmp_path, fails):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with one_rank_group(dist, "gloo", timeout_s=30, prefix="megaport-test-pg-"):
            assert dist.is_initialized() and dist.get_world_size() == 1
            assert len(_stores("megaport-test-pg-")) == 1
            dist.all_reduce(torch.ones(1))
            if fails:
                raise RuntimeError("the run died")
    assert not dist.is_initialized()
    assert _stores("megaport-test-pg-") == set(), "the store's directory was left in the temp dir"

