"""The stored format: manifests (and the legacy v1 reader), integrity, the catalog of checkpoints, lineage, coverage."""
