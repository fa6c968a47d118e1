"""Parallel layouts: how a training run is spread over ranks and nodes (:mod:`.spec`, :mod:`.registry`)."""
