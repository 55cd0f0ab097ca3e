# The two commands a fresh machine needs: `make demo` and `make test`. Each installs what it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean browser

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,s3]'
	touch $(STAMP)

# The whole pipeline offline on a synthetic world (4-7 minutes on 2 cores); a rerun resumes it.
demo: $(STAMP)
	$(VENV)/bin/hype demo --out runs/demo

test: $(STAMP) browser
	$(PY) -m pytest -q

# The HTML report test drives headless Chromium (Debian package `chromium`). Installed when we are root
# (CI); otherwise that one test is skipped with a message saying how to install it.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (apt-get) for the HTML report test"; \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: chromium not found; the HTML report test will be skipped (apt-get install chromium)"; fi; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf runs .pytest_cache
