# `make run` and `make test` both create .venv/ (scripts/install.sh) when it is missing or stale.
PY := .venv/bin/python
STAMP := .venv/.cnr-install-stamp

.PHONY: install run test bench clean

$(STAMP): scripts/install.sh pyproject.toml
	bash scripts/install.sh

install: $(STAMP)

# Trains the tiny DLRM with Check-N-Run on the embedded default storage (./checkpoints).
# A second `make run` continues the same job from its newest committed checkpoint.
run: install
	@if [ -d checkpoints/checkpoints ]; then RESUME=--resume; fi; \
	$(PY) -m cnr train --config configs/tiny.yaml --storage ./checkpoints --set train.steps=$${STEPS:-200} $$RESUME

# Two workers: most tests wait on processes they start, so two share the 2 cores well
# (12:03 and 12:39 against 14:00 in one worker, the same suite on this 2-core machine).
test: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests

clean:
	rm -rf checkpoints bench-out
