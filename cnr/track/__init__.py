"""What a checkpoint captures: the row trackers on sharded tables, the app state, the snapshot."""
