# Two commands do all the set-up: `make demo` (the main job: paratrain train) and `make test` (what CI runs).
# Both create .venv on first use and install paratrain with the versions pinned in .ci/constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup datasets clean
# apt-get needs root: through sudo when make is not run as root.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(BIN)/paratrain: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c .ci/constraints.txt -e ".[dev,train]"
	touch $(BIN)/paratrain

setup: $(BIN)/paratrain

# The datasets that come as Debian packages (nothing is downloaded at run time): Fashion-MNIST (IDX files under
# /usr/share/datasets/fashion-mnist/) and the fortunes text corpus (/usr/share/games/fortunes/).
datasets:
	$(SUDO) apt-get install -y dataset-fashion-mnist fortunes || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y dataset-fashion-mnist fortunes; }

demo: setup
	$(BIN)/paratrain train

test: setup
	$(BIN)/ruff check paratrain tests
	$(BIN)/ruff format --check paratrain tests
	$(BIN)/mypy --strict paratrain
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
