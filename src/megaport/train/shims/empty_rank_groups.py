"""``empty-rank-groups``: a process group of no ranks is no group, as upstream's e43abe7dfa made it.

From 9208adbdc7 (2024-03-27) until e43abe7dfa reached main (2024-04-12, core 0.6.0 included)
upstream's ``initialize_model_parallel`` asks for expert groups of no ranks whenever context
parallelism is above 1; torch reads an empty list as the default group and raises a ``TypeError``
building it, so an unported CP2 run of that window never starts. Here ``torch.distributed.new_group``
answers an empty rank list with "not a member" on every rank: at EP 1 the groups are upstream's fix.
The port fixes the same window in its own way (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

from megaport.train.shims._pattern import Match

NAME = "empty-rank-groups"
DESCRIPTION = ("a process group of no ranks is no group: every rank is outside it (upstream's own e43abe7dfa, "
               "which stopped asking for the CP > 1 expert groups of no ranks)")
ERAS = "main 2024-03-27 (9208adbdc7) … 2024-04-12 (e43abe7dfa), with context parallelism > 1"
REPRODUCES = "upstream's e43abe7dfa (2024-04-04, on main 2024-04-12)"
PATTERN = (Match(("TypeError",), message=r"incompatible constructor arguments", file=r"parallel_state\.py"),)


def install() -> None:
    import torch.distributed as dist

    made = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        if ranks is not None and not list(ranks):
            return dist.GroupMember.NON_GROUP_MEMBER
        return made(ranks, *args, **kwargs)

    dist.new_group = new_group
