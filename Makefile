# Every target installs what it needs into .venv first (from requirements*.txt).
# Where torch is already importable (GPU images) the venv sees it instead of reinstalling it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
NGPU   := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)
RUN    ?= out/$(if $(filter 0,$(NGPU)),tiny,small)

.PHONY: install train sample test bench lint clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

data/pystdlib/meta.json: | install
	$(PY) data/prepare.py pystdlib

# CPU: the tiny model for about 5 minutes. GPU node: the small model on every GPU, bf16, compiled.
train: install data/pystdlib/meta.json
ifeq ($(NGPU),0)
	$(PY) train.py --model tiny --steps 400 --global-batch 32 --micro-batch 16 --lr 3e-3 --warmup 20 \
		--eval-every 100 --log-every 50 --out $(RUN) --metrics $(RUN)/metrics.jsonl
else
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NGPU) train.py --model small --dtype bf16 --compile \
		--steps 2000 --global-batch $$((32 * $(NGPU))) --micro-batch 16 --lr 1e-3 --min-lr 1e-4 --warmup 100 \
		--eval-every 250 --log-every 50 --save-every 500 --out $(RUN) --metrics $(RUN)/metrics.jsonl
endif

sample: install
	$(PY) sample.py --run $(RUN) --prompt "def " --max-new-tokens 300 --temperature 0.8 --top-k 40

test: install
	$(PY) -m pytest -q --durations=10 tests

bench: install data/pystdlib/meta.json
	$(PY) bench/run_all.py

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf out runs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
