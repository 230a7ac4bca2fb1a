"""Helpers shipped for tests of cnr and of third-party stores, and for cnr's system tests
(cnr.systest): the storage contract, a local S3 server and a fault-injecting proxy before it, an
in-memory store, small torchrec jobs, synthetic production-shaped state, process trees and
multi-node launches on one machine. Library level: nothing here imports cnr.app."""
