# Two entry points; see README.md.
VENV ?= .venv

.PHONY: run test

run:  ## install vacancyd into $(VENV) and run it on its embedded default config
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e .
	$(VENV)/bin/vacancyd run

test:  ## install everything the tests need, build fixtures, run lint, types and tests
	VACANCYD_VENV=$(VENV) bash tools/test.sh
