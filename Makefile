# Two entry points (README): `make up` runs a local cluster, `make test` runs the test suite.
# Both create .venv and install everything first, so they work on a fresh machine.
# `make image` builds the Dockerfile without a daemon (root, buildah, debootstrap: .ci/build_image.py).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up test bench image

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	bash .ci/install_helm.sh .tools/bin
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/cbserve up --demo

test: install
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(VENV)/bin/pytest -q --durations=40

image: install
	$(PY) .ci/build_image.py
