"""compshard: fully sharded data-parallel training as a torch.compile backend."""
