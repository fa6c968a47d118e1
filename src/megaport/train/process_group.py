"""A one-rank process group for runs inside one interpreter (the harness, verify's own tests).

Its file store lives in a directory of its own for as long as the group: the group is destroyed and
the directory removed when the run ends, failed or not. A ``mkdtemp`` left behind was one empty
``megaport-gpt-*`` directory in the temp dir per harness run, ported and unported, every verify.
"""

from __future__ import annotations

import contextlib
import datetime
import tempfile


@contextlib.contextmanager
def one_rank_group(dist, backend: str, timeout_s: int = 300, prefix: str = "megaport-pg-"):
    """``dist.init_process_group`` for rank 0 of 1 on a file store, undone on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as store:
        dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
