"""What a training run is compared with (:mod:`.registry`): unported upstream, or one rank from the same checkpoint."""
