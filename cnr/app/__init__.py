"""The `cnr` command-line application (train, inspect, export, report, bench) built on the library."""
