"""Helpers shipped for tests of cnr and of third-party stores: the storage contract, a local S3 server."""
