"""System tests with verdicts, run as ``python -m cnr bench chaos`` and ``python -m cnr bench
conformance``: whole ``cnr train`` jobs under attack (chaos) and the save/restore matrix over
models, plans and policies (conformance). App level: they import cnr.app;
the library imports nothing from here."""
