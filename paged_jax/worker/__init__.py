"""What runs on the device: the jitted runner, its input batches, attention dispatch, sampling, sharding."""
