# Both targets build .venv/ from nothing with Python 3.11 (and reuse it when pyproject.toml is unchanged).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.k3load-installed

.PHONY: demo test lint clean browser prometheus nginx openssh fuzz

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "k3load needs Python 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/k3load demo

test: $(STAMP) browser prometheus nginx openssh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python scripts/typecheck.py
	K3LOAD_BESIDE=1 $(VENV)/bin/python -m pytest -m "vllm or not vllm" --durations=40

# Debian's chromium renders the HTML report in a test, and with Debian's chromium-driver (selenium, from the
# dev extra, drives it) the web UI's k3load tab in another (each installed when missing and apt is usable).
browser:
	@command -v chromium >/dev/null 2>&1 || (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	  >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	  >/dev/null)) || echo "chromium unavailable: the report test skips outside CI"
	@command -v chromedriver >/dev/null 2>&1 || (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  chromium-driver >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
	  -y -qq chromium-driver >/dev/null)) || echo "chromium-driver unavailable: the web UI browser test skips outside CI"

# Debian's prometheus scrapes the sim in a test, and its promtool checks alerts.yaml (installed when missing and
# apt is usable).
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
	  >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
	  >/dev/null)) || echo "prometheus unavailable: the Prometheus test skips outside CI"

# Debian's nginx stands in front of the sim in a test (buffered and unbuffered streams, two upstreams, a short
# read timeout), run unprivileged on a loopback port (installed when missing and apt is usable).
nginx:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx \
	  >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx \
	  >/dev/null)) || echo "nginx unavailable: the nginx stream test skips outside CI"

# Debian's OpenSSH client signs and verifies the record in a test (ssh-keygen -Y; ssh-agent for a protected key),
# installed when missing and apt is usable.
openssh:
	@command -v ssh-keygen >/dev/null 2>&1 && command -v ssh-agent >/dev/null 2>&1 || (DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq openssh-client >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq openssh-client >/dev/null)) || echo "openssh-client unavailable: the signing tests skip outside CI"

# The property tests for a time budget (random seeds, round after round): make fuzz SECONDS=600
SECONDS ?= 300
fuzz: $(STAMP)
	$(VENV)/bin/python scripts/fuzz.py --seconds $(SECONDS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python scripts/typecheck.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
