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

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf checkpoints bench-out
