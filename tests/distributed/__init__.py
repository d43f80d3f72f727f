"""DistributedDataParallel, FSDP2 and route() in gloo process groups."""
