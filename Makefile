# `make run` and `make test` both create .venv/ (scripts/install.sh) when it is missing or stale.
PY := .venv/bin/python
STAMP := .venv/.cnr-install-stamp

.PHONY: install run test test-slow test-all bench clean

$(STAMP): scripts/install.sh pyproject.toml
	bash scripts/install.sh

install: $(STAMP)

# Trains the tiny DLRM with Check-N-Run on the embedded default storage (./checkpoints).
# A second `make run` continues the same job from its newest committed checkpoint.
run: install
	@if [ -d checkpoints/checkpoints ]; then RESUME=--resume; fi; \
	$(PY) -m cnr train --config configs/tiny.yaml --storage ./checkpoints --set train.steps=$${STEPS:-200} $$RESUME

# Two workers: most tests wait on processes they start, so two share the 2 cores well.
# `make test` leaves out the tests marked `slow` (end-to-end jobs trained, killed and resumed
# several times over: their cheaper siblings stay in); `make test-slow` runs just those, and
# `make test-all` both. CI (.ci/run) runs `make test` and then `make test-slow`.
test: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m slow tests

test-all: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests

clean:
	rm -rf checkpoints bench-out
